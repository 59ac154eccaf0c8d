"""The ``verl.plugins`` entry point: ``import verl`` imports this module in every process and it installs grpo-fast's
backend and losses (``grpo_fast.integrations.verl.install``).

verl logs a plugin's import error at debug level only; this module says at warning level why grpo-fast could not be
installed, so that a config asking for ``impl_backend=grpo_fast`` does not fail later without the reason.
"""

import logging

try:
    from grpo_fast.integrations.verl import install

    install()
except Exception as error:  # noqa: BLE001 - reported, not swallowed: verl would hide it
    logging.getLogger(__name__).warning("grpo-fast: could not add its verl backend and losses (%s: %s)",
                                        type(error).__name__, error)
