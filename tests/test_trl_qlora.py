"""``FastGRPOTrainer`` with a 4-bit base and a ``peft_config`` (TRL's QLoRA: ``quantization_config=`` and
``peft_config=`` on the trainer) against TRL 1.16's ``GRPOTrainer`` with the same arguments.

The oracle is TRL's own ``_compute_loss`` on materialised float64 logits (``MaterializedLogitsGRPOTrainer``) of a
float64 model whose weights are the 4-bit model's, dequantized, carrying the same adapters: the function the 4-bit
trainers compute, in exact arithmetic. One generated batch goes through ``_compute_loss`` of the three trainers
(tests/test_trl_integration.py's ``LossPath``), under the project's tolerance rule at float32; TRL stores QLoRA
adapters in bfloat16, so both trainers' adapter gradients are bfloat16 and the rule's bound follows TRL's own
error. A quantized lm_head (``llm_int8_skip_modules=[]``) is refused when the trainer is built.
"""

from __future__ import annotations

import pytest

trl = pytest.importorskip("trl")
bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")
pytestmark = [pytest.mark.filterwarnings("ignore:.*gradient_checkpointing.*:FutureWarning")]

import torch  # noqa: E402
from test_qlora import dequantized_copy  # noqa: E402
from test_trl_integration import G, PROMPTS, LossPath, _assert_loss_parity  # noqa: E402
from transformers import AutoModelForCausalLM, BitsAndBytesConfig  # noqa: E402
from trl import GRPOTrainer  # noqa: E402
from trl_fixtures import MaterializedLogitsGRPOTrainer, build_tiny_grpo_trainer, save_tiny_model, token_sum_reward  # noqa: E402,E501

from grpo_fast.integrations.trl import FastGRPOTrainer  # noqa: E402

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0)


def quantization_config(**kw):
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.float32, **kw)



class QLoraLossPath(LossPath):
    """Fast and TRL on the 4-bit model with TRL's ``peft_config``, the float64 oracle on its dequantized copy with
    the same adapters; adapters set away from LoRA's zero ``B`` (to bfloat16 values, which TRL stores them in), so
    they change the function and every adapter matrix gets a gradient."""

    def __init__(self, model_dir, output_dir, prompts=PROMPTS[:2], **config):
        settings = dict(per_device_train_batch_size=2 * G, num_generations=G, max_completion_length=8, bf16=False,
                        beta=0.04, num_iterations=2)
        settings.update(config)
        quantized = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=quantization_config())
        oracle_model = peft.get_peft_model(dequantized_copy(quantized, torch.float64), peft.LoraConfig(**LORA))
        self.trainers = {"out_ref": build_tiny_grpo_trainer(model_dir, output_dir / "out_ref", [token_sum_reward()],
                                                            prompts, trainer_cls=MaterializedLogitsGRPOTrainer,
                                                            model=oracle_model, **settings)}
        for name, cls in (("out", FastGRPOTrainer), ("out_pt", GRPOTrainer)):
            kwargs = {"peft_config": peft.LoraConfig(**LORA), "quantization_config": quantization_config()}
            self.trainers[name] = build_tiny_grpo_trainer(model_dir, output_dir / name, [token_sum_reward()],
                                                          prompts, trainer_cls=cls, trainer_kwargs=kwargs, **settings)
        with torch.no_grad():
            for name, trainer in self.trainers.items():
                for pname, p in trainer.model.named_parameters():
                    if "lora_" in pname and ".default." in pname:
                        gen = torch.Generator().manual_seed(sum(map(ord, pname)))
                        p.copy_((0.3 * torch.randn(p.shape, generator=gen)).to(torch.bfloat16))
        trainer = self.trainers["out_pt"]
        trainer.model.train()
        torch.manual_seed(0)
        self.batch = trainer._generate_and_score_completions([{"prompt": p} for p in prompts for _ in range(G)])


@pytest.fixture(scope="module")
def qlora_path(tmp_path_factory):
    model_dir = save_tiny_model(tmp_path_factory.mktemp("qwen2_untied"))
    return QLoraLossPath(model_dir, tmp_path_factory.mktemp("qlora_path"))


def test_trainers_hold_trls_qlora_model(qlora_path):
    """What TRL builds, and what the comparison runs on: a 4-bit decoder, a float32 lm_head, bfloat16 adapters
    (TRL's QLoRA cast) as the only trained parameters, the same in both trainers."""
    models = {name: qlora_path.trainers[name].model for name in ("out", "out_pt")}
    for model in models.values():
        assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
        assert model.get_output_embeddings().weight.dtype == torch.float32
        trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
        assert trained and all("lora_" in n and p.dtype == torch.bfloat16 for n, p in trained.items())
    fast, trls = (dict(m.named_parameters()) for m in models.values())
    assert fast.keys() == trls.keys() and all(torch.equal(fast[k], trls[k]) for k in fast if "lora_" in k)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo"])
def test_qlora_loss_matches_grpo_trainer(qlora_path, loss_type):
    results = qlora_path.run(qlora_path.batch, loss_type=loss_type)
    _assert_loss_parity(results)
    grads = results["out"][1]
    assert grads.numel() == sum(p.numel() for n, p in qlora_path.trainers["out"].model.named_parameters()
                                if p.requires_grad) and bool((grads != 0).any())


def test_quantized_lm_head_is_refused(tmp_path):
    """``llm_int8_skip_modules=[]`` quantizes the untied lm_head too; the fused loss cannot read it."""
    model_dir = save_tiny_model(tmp_path / "model")
    kwargs = {"peft_config": peft.LoraConfig(**LORA), "quantization_config": quantization_config(
        llm_int8_skip_modules=[])}
    with pytest.raises(ValueError, match=r"a quantized lm_head \(weight dtype torch\.uint8\): the fused log-prob op "
                                         r"needs a floating-point weight"):
        build_tiny_grpo_trainer(model_dir, tmp_path / "out", [token_sum_reward()], PROMPTS[:2],
                                trainer_cls=FastGRPOTrainer, trainer_kwargs=kwargs, bf16=False)
