"""What fits on a GPU: the memory model of one GRPO (or PPO) training step and the ``grpo-fast fit`` command.

``models``: the registry of real architectures (shapes only); ``projection``: the step's bytes by phase and component
from the parameter count and measured coefficients (``calibration.json``, shipped with the package); ``fit``: the
command. The measurements that produce the coefficients need the memory tracker of ``bench/`` (a source checkout):
``grpo-fast fit --calibrate``.
"""
