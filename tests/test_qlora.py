"""QLoRA and the optimizers: ``--load-in-4bit`` (the base's linear layers in 4 bits through bitsandbytes, LoRA on
top) and ``--optim`` (torch's AdamW fused or not, bitsandbytes' 8-bit and paged AdamW).

- The 4-bit model computes what a float model with the dequantized weights computes (the tolerance rule against a
  float64 copy of that model); its lm_head and embedding stay floating-point (tied ones stay tied); the adapters are
  float32 and the reference is the base with the adapters disabled.
- A 4-bit run trains, writes the PEFT adapter, checkpoints only the adapters and resumes bit-exactly; --merge-lora
  writes the dequantized weights plus the adapters; grpo-fast export makes the same from a checkpoint.
- The 8-bit optimizer keeps uint8 states (the embedding 32-bit, as transformers does) and trains a full fine-tune.
- Every refusal is one line naming the option: 4-bit without bitsandbytes, without LoRA, with a quantized lm_head,
  under FSDP2; paged optimizers off CUDA.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from train_helpers import small_config

bnb = pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

from grpo_fast.cli import main  # noqa: E402
from grpo_fast.testing import assert_close_rule  # noqa: E402
from grpo_fast.train import checkpoint as ckpt  # noqa: E402
from grpo_fast.train import distributed as dist_  # noqa: E402
from grpo_fast.train import train  # noqa: E402
from grpo_fast.train.metrics import read_steps  # noqa: E402
from grpo_fast.train.model import (  # noqa: E402
    attach_lora,
    check_4bit_head,
    is_4bit,
    load_model_and_tokenizer,
    make_optimizer,
    merge_4bit_lora,
)
from grpo_fast.train.tasks import builtin_records, tiny_model, tiny_tokenizer  # noqa: E402
from grpo_fast.train.trainer import setup  # noqa: E402

CPU = torch.device("cpu")
QLORA = dict(load_in_4bit=True, lora_r=4, lora_target_modules=["q_proj", "v_proj", "up_proj"], lr=0.02)



def _batch(tokenizer, n=8):
    texts = [r["prompt"] for r in builtin_records("digits", "eval", n)]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc.input_ids, enc.attention_mask


def _logprobs(model, ids, mask):
    """Log-probs ``[B, T-1]`` of every next prompt token with the model's own forward (its logits)."""
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits[:, :-1].double()
    return logits.log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0] * mask[:, 1:]


def dequantized_copy(model, dtype):
    """A plain transformers model of ``model``'s architecture whose weights are ``model``'s, its 4-bit ones
    dequantized, in ``dtype``: what the 4-bit model computes, without bitsandbytes."""
    from bitsandbytes.functional import dequantize_4bit
    from transformers import AutoModelForCausalLM

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = copy.deepcopy(inner.config)
    del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    state = {}
    for name, module in inner.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            state[f"{name}.weight"] = dequantize_4bit(module.weight.data, module.weight.quant_state)
            if module.bias is not None:
                state[f"{name}.bias"] = module.bias
    for name, tensor in inner.state_dict().items():
        if name not in state and name in plain.state_dict():
            state[name] = tensor
    missing, unexpected = plain.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # tied: the embedding
    return plain


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    config = small_config(tmp_path_factory.mktemp("quantized"), **QLORA)
    model, tokenizer = load_model_and_tokenizer(config, CPU, torch.float32)
    return model, tokenizer, config


# --------------------------------------------------------------------------------------------- the 4-bit model


def test_4bit_model_is_the_dequantized_model(quantized):
    model, tokenizer, config = quantized
    assert is_4bit(model)
    layer = model.model.layers[0]
    quantized_layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantized_layers) == 2 * 7  # every decoder projection, nothing else
    assert layer.self_attn.q_proj.weight.dtype == torch.uint8
    assert layer.self_attn.q_proj.weight.quant_state.quant_type == "nf4"
    assert layer.self_attn.q_proj.weight.quant_state.nested  # double quantization, the default
    # the lm_head and the embedding stay floating-point, in the compute dtype, and tied
    assert model.lm_head.weight.dtype == torch.float32 and model.lm_head.weight is model.model.embed_tokens.weight
    ids, mask = _batch(tokenizer)
    with torch.no_grad():
        out = _logprobs(model, ids, mask)
        out_pt = _logprobs(dequantized_copy(model, torch.float32), ids, mask)
        out_ref = _logprobs(dequantized_copy(model, torch.float64), ids, mask)
    assert_close_rule(out, out_pt, out_ref, torch.float32, "4-bit model log-probs")
    # and the rounding is real: the original float weights compute something else
    original = tiny_model(tiny_tokenizer(), config.seed).eval()
    with torch.no_grad():
        assert float((_logprobs(original, ids, mask) - out_ref).abs().max()) > 1e-3


def test_fp4_and_single_quantization(tmp_path):
    config = small_config(tmp_path, **QLORA, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=False)
    model, _ = load_model_and_tokenizer(config, CPU, torch.float32)
    state = model.model.layers[1].mlp.down_proj.weight.quant_state
    assert state.quant_type == "fp4" and not state.nested


def test_adapters_are_float32_and_the_reference_is_the_base(quantized):
    model, tokenizer, config = quantized
    peft_model = attach_lora(copy.deepcopy(model), config)
    trained = {n: p for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n and p.dtype == torch.float32 for n, p in trained.items())
    with torch.no_grad():
        for p in trained.values():  # adapters that change the function
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    ids, mask = _batch(tokenizer)
    with torch.no_grad():
        with peft_model.disable_adapter():
            reference = _logprobs(peft_model, ids, mask)
        assert torch.equal(reference, _logprobs(model, ids, mask))
        assert float((_logprobs(peft_model, ids, mask) - reference).abs().max()) > 1e-3


def test_bf16_compute_dtype(tmp_path):
    """On a bf16 compute dtype the unquantized weights are bf16, the 4-bit matmuls compute in bf16, and the
    adapters still float32 (TRL casts QLoRA adapters to bf16; grpo-fast keeps them as its LoRA does)."""
    config = small_config(tmp_path, **QLORA, dtype="bfloat16")
    model, _ = load_model_and_tokenizer(config, CPU, torch.bfloat16)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.layers[0].self_attn.q_proj.compute_dtype == torch.bfloat16
    peft_model = attach_lora(model, config)
    assert {p.dtype for p in peft_model.parameters() if p.requires_grad} == {torch.float32}


# ------------------------------------------------------------- bitsandbytes' CPU inference layout (AVX512-BF16)


def packed_gemv_reference(A, B, out=None, transposed_A=False, transposed_B=False, state=None):
    """What bitsandbytes' repacked CPU kernel computes, in torch: the nibbles of the ``[N, K/2]`` packed weight back
    in ``[N, K]`` order, each times its block's bf16 scale, the matmul in bf16. It stands in for the kernel on a CPU
    without AVX512-BF16, where bitsandbytes registers no kernel for the repacked layout (its generic one would read the
    repacked weight as if it were not)."""
    n, k = state.shape
    p = B.reshape(-1, 32)
    nibbles = torch.cat([p & 0xF, p >> 4], -1).reshape(n // 32, k // 2, 32, 2).transpose(1, 2).reshape(n, k)
    scales = state.absmax.T.float().repeat_interleave(state.blocksize, dim=1)  # packed: [K / blocksize, N] bf16
    weight = (state.code.float()[nibbles.long()] * scales).to(torch.bfloat16)
    result = (A.to(torch.bfloat16) @ weight.T).to(A.dtype)
    if out is not None:
        out.copy_(result)
        return out
    return result


@pytest.fixture
def avx512bf16_cpu(monkeypatch):
    """This CPU as one with AVX512-BF16 to bitsandbytes and grpo-fast: layers built from here on switch on their
    repacking, and where the CPU lacks the instruction the repacked kernel is its torch equivalent."""
    import bitsandbytes.functional as bnb_functional
    import bitsandbytes.nn.modules as bnb_modules

    from grpo_fast import bnb_layout

    if not bnb_layout.cpu_has_avx512bf16():
        monkeypatch.setattr(bnb_functional, "gemv_4bit", packed_gemv_reference)
    monkeypatch.setattr(bnb_modules, "has_avx512bf16", lambda: True)
    monkeypatch.setattr(bnb_layout, "cpu_has_avx512bf16", lambda: True)


def _layout_bytes(model) -> list:
    """Every 4-bit layer's weight bytes and quantization state, to compare bit for bit."""
    from grpo_fast.bnb_layout import linear4bit_layers

    out = []
    for layer in linear4bit_layers(model):
        state = layer.weight.quant_state.as_dict(packed=True)
        out.append((layer.weight.data.dtype, layer.weight.data.view(torch.uint8).clone(),
                    {k: v.view(torch.uint8).clone() if torch.is_tensor(v) else v for k, v in state.items()}))
    return out


@pytest.mark.skipif(not __import__("grpo_fast.bnb_layout").bnb_layout.cpu_has_avx512bf16(),
                    reason="bitsandbytes' repacked CPU kernel needs the avx512_bf16 CPU flag, which this CPU lacks "
                           "(the tests with avx512bf16_cpu run its torch equivalent here)")
def test_packed_kernel_reference_is_the_kernel(tmp_path):
    """On a CPU that has the kernel, its torch stand-in (used where the CPU has not) computes what it computes."""
    from grpo_fast.bnb_layout import inference_layout, linear4bit_layers

    model, _ = load_model_and_tokenizer(small_config(tmp_path, **QLORA, dtype="bfloat16"), CPU, torch.bfloat16)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with inference_layout(model):
        for layer in linear4bit_layers(model):
            if layer.in_features == 64:
                want = bnb.functional.gemv_4bit(x, layer.weight.data, state=layer.weight.quant_state)
                got = packed_gemv_reference(x, layer.weight.data, state=layer.weight.quant_state)
                assert float((got.float() - want.float()).abs().max()) <= 2 * 2**-8 * float(want.abs().max())


def test_the_trainer_never_repacks_by_itself(tmp_path, avx512bf16_cpu):
    """bitsandbytes repacks a layer in its first eval-mode forward without grad on such a CPU (as a plain
    from_pretrained model here shows); the trainer's 4-bit model keeps its layout through such a forward."""
    from transformers import AutoModelForCausalLM

    from grpo_fast.bnb_layout import is_packed, keep_training_layout, linear4bit_layers
    from grpo_fast.train.model import bnb_4bit_config

    config = small_config(tmp_path, **QLORA, dtype="bfloat16")
    model, tokenizer = load_model_and_tokenizer(config, CPU, torch.bfloat16)
    layers = linear4bit_layers(model)
    assert layers and not any(layer.support_avx512bf16_for_cpu for layer in layers)
    ids, mask = _batch(tokenizer)
    with torch.no_grad():
        _logprobs(model.eval(), ids, mask)
    assert not any(is_packed(layer) for layer in layers)

    model.save_pretrained(tmp_path / "plain")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "plain", dtype=torch.bfloat16,
                                                 quantization_config=bnb_4bit_config(config, torch.bfloat16)).eval()
    with torch.no_grad():
        _logprobs(plain, ids, mask)
    assert all(is_packed(layer) for layer in linear4bit_layers(plain))
    with pytest.raises(ValueError, match=r"^FastGRPOTrainer model: 14 of 14 4-bit layers are already in .*load the "
                                         r"model again"):
        keep_training_layout(plain, "FastGRPOTrainer model")


def _saved_qwen2(directory, **overrides) -> str:
    """The tiny model's architecture with an untied lm_head (and ``overrides`` on its config), random weights, and
    the tiny tokenizer, saved."""
    from transformers import Qwen2ForCausalLM

    tokenizer = tiny_tokenizer()
    config = tiny_model(tokenizer, seed=1).config
    config.update({"tie_word_embeddings": False, **overrides})
    torch.manual_seed(1)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.mark.parametrize("variant", ["nf4", "fp4 single quantization", "unpackable mlp"])
def test_training_after_a_repacked_generation_is_unchanged(tmp_path, avx512bf16_cpu, caplog, monkeypatch, variant):
    """A bf16 run generates in the repacked layout (the log says so); afterwards every 4-bit layer holds its
    weight and scales bit for bit, and a training forward and backward gives the loss and adapter gradients of a
    twin that never repacked. Variants: FP4 without double quantization (no nested scales to keep), and an MLP
    width (80) bitsandbytes does not repack, whose layers stay in the training layout while the others repack."""
    from grpo_fast.bnb_layout import is_packed, linear4bit_layers
    from grpo_fast.train import prepare
    from grpo_fast.train.rollout import HFEngine, SamplingParams

    options = {"nf4": {}, "fp4 single quantization": dict(bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=False),
               "unpackable mlp": dict(model=_saved_qwen2(tmp_path / "qwen2-80", intermediate_size=80))}[variant]
    config = small_config(tmp_path, **QLORA, dtype="bfloat16", **options)
    runs = [prepare(config).run for _ in range(2)]
    packable = 8 if variant == "unpackable mlp" else 14  # q, k, v, o of 2 layers (+ gate, up, down)
    before = _layout_bytes(runs[0].model)
    assert _same(before, _layout_bytes(runs[1].model))
    ids, mask = _batch(runs[0].tokenizer, n=4)
    monkeypatch.setattr("grpo_fast.train.rollout._LAYOUTS", {})  # decided (and logged) in prepare's evaluation
    with caplog.at_level("INFO", logger="grpo_fast.train"):
        engine = HFEngine(runs[0])
    assert engine.packed_4bit
    assert (f"4-bit generation layout: repacked for inference (bfloat16 on a CPU with AVX512-BF16: bitsandbytes' "
            f"repacked inference kernel, {packable} of 14 4-bit layers)") in caplog.text

    from grpo_fast.train import rollout

    seen = []

    def spy(model, *args, **kwargs):  # the layout while the engine samples
        seen.append([is_packed(layer) for layer in linear4bit_layers(model)])
        return generate(model, *args, **kwargs)

    generate = rollout.generate
    monkeypatch.setattr(rollout, "generate", spy)
    out = engine.generate(ids, mask, 4, SamplingParams(3, 1.0, 1.0, 0), eos_token_id=0,
                          pad_token_id=runs[0].tokenizer.pad_token_id, seed=0)
    assert out.completion_ids.shape[0] == 16
    assert [sum(layers) for layers in seen] == [packable]
    assert _same(_layout_bytes(runs[0].model), before)
    for layer in linear4bit_layers(runs[0].model):  # the fields as_dict leaves out when not nested, too
        state = layer.weight.quant_state
        assert not is_packed(layer) and state.nested == (variant != "fp4 single quantization")
        assert hasattr(state, "state2") and (state.state2 is None) == (not state.nested)

    losses, grads = [], []
    for r in runs:
        r.model.train()
        with torch.autocast("cpu", torch.bfloat16):
            loss = -_logprobs(r.model, ids, mask).sum()
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in r.model.named_parameters() if p.requires_grad})
    assert torch.equal(losses[0], losses[1])
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        assert grads[0][name] is not None and torch.equal(grads[0][name], grads[1][name]), name


def test_repacked_generation_restores_after_an_error(tmp_path, avx512bf16_cpu):
    from grpo_fast.bnb_layout import inference_layout, is_packed, linear4bit_layers

    model, _ = load_model_and_tokenizer(small_config(tmp_path, **QLORA, dtype="bfloat16"), CPU, torch.bfloat16)
    before = _layout_bytes(model)
    with pytest.raises(KeyboardInterrupt):
        with inference_layout(model):
            assert all(is_packed(layer) for layer in linear4bit_layers(model))
            raise KeyboardInterrupt
    assert _same(_layout_bytes(model), before)


def test_an_interrupted_repacking_puts_every_layer_back(tmp_path, avx512bf16_cpu, monkeypatch):
    """Ctrl-C (or memory) while bitsandbytes repacks the third layer, after it changed that layer's state in place:
    the two layers already repacked and the third are all back as they were, and the interrupt goes on."""
    import bitsandbytes.functional as bnb_functional

    from grpo_fast.bnb_layout import inference_layout

    model, _ = load_model_and_tokenizer(small_config(tmp_path, **QLORA, dtype="bfloat16"), CPU, torch.bfloat16)
    before = _layout_bytes(model)
    real, calls = bnb_functional._convert_weight_packed_for_cpu, []

    def interrupted(weight, state, *args):
        calls.append(1)
        out = real(weight, state, *args)  # the state is changed in place here
        if len(calls) == 3:
            raise KeyboardInterrupt
        return out

    monkeypatch.setattr(bnb_functional, "_convert_weight_packed_for_cpu", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with inference_layout(model):
            pytest.fail("the block ran")
    assert len(calls) == 3 and _same(_layout_bytes(model), before)


def test_a_failing_restore_still_restores_the_other_layers(tmp_path, avx512bf16_cpu, monkeypatch):
    from grpo_fast import bnb_layout

    model, _ = load_model_and_tokenizer(small_config(tmp_path, **QLORA, dtype="bfloat16"), CPU, torch.bfloat16)
    layers = bnb_layout.linear4bit_layers(model)
    before = _layout_bytes(model)
    real = bnb_layout._restore

    def failing(layer, scales):
        if layer is layers[5]:
            raise MemoryError("no memory for the nibbles")
        real(layer, scales)

    monkeypatch.setattr(bnb_layout, "_restore", failing)
    with pytest.raises(MemoryError, match="no memory for the nibbles"):
        with bnb_layout.inference_layout(model):
            pass
    after = _layout_bytes(model)
    assert [bnb_layout.is_packed(layer) for layer in layers] == [i == 5 for i in range(14)]
    assert all(_same(after[i], before[i]) for i in range(14) if i != 5)


def test_a_bitsandbytes_that_repacks_otherwise_is_left_in_the_training_layout(tmp_path, avx512bf16_cpu,
                                                                                 monkeypatch):
    """If a bitsandbytes release changes its private repacked format (here: blocks of 64 rows, not 32), the round
    trip check sees the restore is not exact and generation stays in the training layout."""
    import bitsandbytes.functional as bnb_functional

    from grpo_fast.bnb_layout import packed_generation

    model, _ = load_model_and_tokenizer(small_config(tmp_path, **QLORA, dtype="bfloat16"), CPU, torch.bfloat16)
    before = _layout_bytes(model)
    real = bnb_functional._convert_weight_packed_for_cpu
    monkeypatch.setattr(bnb_functional, "_convert_weight_packed_for_cpu",
                        lambda weight, state, block_n=32: real(weight, state, block_n=64))
    assert packed_generation(model, CPU, torch.bfloat16) == (
        False, "this bitsandbytes repacks in a layout grpo-fast cannot undo exactly (its private format changed)")
    monkeypatch.setattr(bnb_functional, "_convert_weight_packed_for_cpu", real)
    assert packed_generation(model, CPU, torch.bfloat16)[0]
    assert _same(_layout_bytes(model), before)  # the check itself leaves the layer as it was


def test_without_avx512bf16_a_bf16_run_generates_in_the_training_layout(tmp_path, monkeypatch):
    """The other side of the flag, forced on any CPU: bitsandbytes builds its layers without repacking, grpo-fast
    says why it keeps the training layout, and a bf16 4-bit run trains."""
    import bitsandbytes.nn.modules as bnb_modules

    from grpo_fast import bnb_layout

    monkeypatch.setattr(bnb_modules, "has_avx512bf16", lambda: False)
    monkeypatch.setattr(bnb_layout, "cpu_has_avx512bf16", lambda: False)
    model, _ = load_model_and_tokenizer(small_config(tmp_path / "m", **QLORA, dtype="bfloat16"), CPU, torch.bfloat16)
    assert bnb_layout.packed_generation(model, CPU, torch.bfloat16) == (
        False, "this CPU has no AVX512-BF16, which bitsandbytes' repacked kernel needs")
    packs = []
    real = bnb_layout._repack
    monkeypatch.setattr(bnb_layout, "_repack", lambda layers: packs.append(len(layers)) or real(layers))
    summary = train(small_config(tmp_path, **QLORA, dtype="bfloat16", steps=2))
    assert summary.skipped_updates == 0 and packs == []


def test_float32_runs_generate_in_the_training_layout(tmp_path, avx512bf16_cpu):
    """The repacked kernel computes in bf16: a float32 run keeps sampling from the policy it trains."""
    from grpo_fast.bnb_layout import packed_generation

    model, _ = load_model_and_tokenizer(small_config(tmp_path, **QLORA), CPU, torch.float32)
    assert packed_generation(model, CPU, torch.float32) == (
        False, "the run computes in float32; bitsandbytes' repacked CPU kernel computes in bfloat16, which would "
               "sample from another policy than the one trained")
    assert packed_generation(model, CPU, torch.bfloat16)[0]
    assert packed_generation(model, torch.device("meta"), torch.bfloat16)[0] is False


def test_repacked_bf16_run_of_a_qwen2_with_attention_biases(tmp_path, avx512bf16_cpu):
    """A saved Qwen2 with q/k/v biases (bitsandbytes' repacked path adds a bias in place, which failed in training)
    trains with 8-bit AdamW from its save_pretrained directory, generations repacked."""
    model_dir = _saved_qwen2(tmp_path / "qwen2-bias")
    assert "q_proj.bias" in " ".join(__import__("safetensors.torch").torch.load_file(
        f"{model_dir}/model.safetensors"))
    summary = train(small_config(tmp_path, **QLORA, model=model_dir, dtype="bfloat16", optim="adamw_8bit", steps=2))
    steps = read_steps(tmp_path / "run" / "metrics.jsonl")
    assert len(steps) == 2 and summary.skipped_updates == 0
    assert all(torch.isfinite(torch.tensor(s["loss"])) for s in steps)


def test_repacked_bf16_run_resumes_and_merges_exactly(tmp_path, avx512bf16_cpu):
    """A bf16 4-bit run whose generations run repacked: resumed after 2 of 4 steps it ends bit for bit where the
    straight run ends, and --merge-lora at the end writes what a fresh bf16 load of the base with the last
    checkpoint's adapters merges to (its 4-bit weights came back intact from every generation)."""
    from safetensors.torch import load_file

    from grpo_fast.train.model import load_trained_state

    options = dict(**QLORA, dtype="bfloat16", optim="adamw_8bit", save_every=2, keep_checkpoints=0)
    config = small_config(tmp_path / "straight", **options, merge_lora=True)
    train(config)
    train(small_config(tmp_path / "resumed", **dict(options, steps=2)))
    train(small_config(tmp_path / "resumed", **options, resume=True))
    last = [ckpt.read_state(ckpt.list_checkpoints(tmp_path / name / "run" / "checkpoints")[-1][1])
            for name in ("straight", "resumed")]
    assert last[0]["step"] == last[1]["step"] == 4 and _same(last[0]["model"], last[1]["model"])
    assert _same(last[0]["optimizer"], last[1]["optimizer"])
    fresh, _ = load_model_and_tokenizer(config, CPU, torch.bfloat16)
    fresh = attach_lora(fresh, config)
    load_trained_state(fresh, last[0]["model"], config)
    want = {k: v.float() for k, v in merge_4bit_lora(fresh).state_dict().items()}
    got = load_file(tmp_path / "straight" / "run" / "model" / "model.safetensors")
    assert set(got) <= set(want) and all(torch.equal(got[k], want[k]) for k in got)


# --------------------------------------------------------------------------------------------- training


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory):
    """Four steps of a 4-bit run with 8-bit AdamW, a reference (beta > 0), checkpoints after steps 2 and 4."""
    tmp = tmp_path_factory.mktemp("qlora")
    options = dict(**QLORA, optim="adamw_8bit", save_every=2, keep_checkpoints=0, **{"loss.beta": "0.04"})
    summary = train(small_config(tmp, **options))
    return tmp, options, summary


def test_4bit_run_trains_and_writes_the_adapter(qlora_run):
    tmp, options, summary = qlora_run
    run_dir = tmp / "run"
    steps = read_steps(run_dir / "metrics.jsonl")
    assert len(steps) == 4 and summary.skipped_updates == 0
    assert all(s["kl"] >= 0 and torch.isfinite(torch.tensor(s["loss"])) for s in steps) and steps[-1]["kl"] > 0
    names = {p.name for p in (run_dir / "model").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= names and "model.safetensors" not in names
    state = ckpt.read_state(ckpt.list_checkpoints(run_dir / "checkpoints")[-1][1])
    assert state["model"] and all("lora_" in k for k in state["model"])  # the 4-bit base is not in it
    assert any(float(v.abs().max()) > 0 for k, v in state["model"].items() if "lora_B" in k)  # B starts at 0
    exp_avg = [s["__bnb_optimizer_quant_state__"]["state1"] for s in state["optimizer"]["state"].values()]
    # bitsandbytes keeps tensors under 4096 elements (every adapter matrix of this 64-wide model) in 32 bits
    assert exp_avg and all(t.dtype == torch.float32 and t.numel() < 4096 for t in exp_avg)


def test_4bit_resume_is_bit_exact(qlora_run, tmp_path):
    tmp, options, _ = qlora_run
    straight = ckpt.read_state(ckpt.list_checkpoints(tmp / "run" / "checkpoints")[-1][1])
    two = dict(options, steps=2)
    train(small_config(tmp_path, **two))
    train(small_config(tmp_path, **options, resume=True))
    resumed = ckpt.read_state(ckpt.list_checkpoints(tmp_path / "run" / "checkpoints")[-1][1])
    assert resumed["step"] == straight["step"] == 4
    assert resumed["model"].keys() == straight["model"].keys()
    for k in straight["model"]:
        assert torch.equal(resumed["model"][k], straight["model"][k]), k
    assert _same(resumed["optimizer"], straight["optimizer"])


def _same(a, b) -> bool:
    """Nested dicts, lists and tensors equal exactly."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def test_merge_lora_at_the_end_of_a_run(qlora_run, tmp_path, caplog):
    """--merge-lora on a 4-bit run: model/ holds float32 weights without a quantization config, the warning says
    what they are, and grpo-fast export --merge-lora of the final checkpoint writes the same weights."""
    from safetensors.torch import load_file

    tmp, options, _ = qlora_run
    with caplog.at_level("WARNING", logger="grpo_fast.train"):
        train(small_config(tmp_path, **options, merge_lora=True))
    model_dir = tmp_path / "run" / "model"
    assert "quantization_config" not in json.loads((model_dir / "config.json").read_text())
    got = load_file(model_dir / "model.safetensors")
    assert {t.dtype for t in got.values()} == {torch.float32} and not any("lora" in k for k in got)
    warnings = [r.getMessage() for r in caplog.records if "--merge-lora with a 4-bit base" in r.getMessage()]
    assert len(warnings) == 1 and "differ from the original full-precision weights by the 4-bit rounding" in warnings[0]
    exported = tmp_path / "exported"
    assert main(["export", str(ckpt.list_checkpoints(tmp / "run" / "checkpoints")[-1][1]), str(exported),
                 "--merge-lora"]) == 0
    want = load_file(exported / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_merged_model_computes_what_was_trained(tmp_path):
    """merge_4bit_lora on a trained 4-bit model: every merged weight is the dequantized 4-bit weight plus
    ``scaling * B @ A``, and the merged float32 model's log-probs match the 4-bit model's (rule against the merged
    model in float64)."""
    from bitsandbytes.functional import dequantize_4bit

    from grpo_fast.train import fit, prepare

    prepared = prepare(small_config(tmp_path, **QLORA, steps=2))
    fit(prepared)
    model = prepared.run.model.eval()
    ids, mask = _batch(prepared.run.tokenizer)
    with torch.no_grad():
        out_pt = _logprobs(model, ids, mask)
    expected = {}
    for name, module in model.get_base_model().named_modules():
        if isinstance(module, bnb.nn.Linear4bit) and not name.endswith(".base_layer"):  # (LoRA's: below)
            expected[name] = dequantize_4bit(module.weight.data, module.weight.quant_state).float()
        if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer"):
            base = module.base_layer
            expected[name] = (dequantize_4bit(base.weight.data, base.weight.quant_state).float()
                              + module.get_delta_weight("default").float())
    merged = merge_4bit_lora(model)
    assert not any(isinstance(m, bnb.nn.Linear4bit) for m in merged.modules())
    for name, weight in expected.items():
        assert torch.equal(merged.get_submodule(name).weight, weight), name
    with torch.no_grad():
        out = _logprobs(merged, ids, mask)
        out_ref = _logprobs(copy.deepcopy(merged).double(), ids, mask)
    assert_close_rule(out, out_pt, out_ref, torch.float32, "merged model log-probs")


def test_ddp_with_a_4bit_base_and_8bit_adamw_equals_one_process(tmp_path):
    """torchrun with 2 gloo processes under DDP (the set-up a 4-bit base supports besides one process) reaches the
    one-process adapters to the bit (tests/test_distributed.py's comparison)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    from test_distributed import _assert_same, _parameters, _train

    options = ("--steps", "2", "--load-in-4bit", "--lora-r", "4", "--lora-target-modules", "q_proj,v_proj", "--lr",
               "0.02", "--optim", "adamw_8bit", "--save-every", "1", "--keep-checkpoints", "0")
    _train(tmp_path / "one", 1, *options)
    _train(tmp_path / "two", 2, *options, "--distributed", "ddp")
    start, want = _parameters(tmp_path / "one", 1), _parameters(tmp_path / "one", 2)
    assert all("lora_" in name for name in want)  # the adapters: all a 4-bit run's checkpoint holds
    _assert_same(_parameters(tmp_path / "two", 2), want, start)


def test_export_of_a_4bit_checkpoint(qlora_run, tmp_path):
    from peft import PeftModel

    tmp, _, _ = qlora_run
    checkpoint = ckpt.list_checkpoints(tmp / "run" / "checkpoints")[-1][1]
    out = tmp_path / "exported"
    assert main(["export", str(checkpoint), str(out)]) == 0
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in out.iterdir()}
    from safetensors.torch import load_file

    got, want = load_file(out / "adapter_model.safetensors"), load_file(tmp / "run" / "model" /
                                                                        "adapter_model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    config = small_config(tmp_path, **QLORA)
    base, _ = load_model_and_tokenizer(config, CPU, torch.float32)
    loaded = PeftModel.from_pretrained(base, out)  # PEFT loads it onto the 4-bit base
    assert all(torch.equal(p, want[n.replace(".default", "")]) for n, p in loaded.named_parameters() if "lora_" in n)


# --------------------------------------------------------------------------------------------- optimizers


def _params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(64, 80, generator=gen).requires_grad_(), torch.randn(7, generator=gen).requires_grad_()]


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"])
def test_torch_adamw_is_torchs(tmp_path, optim):
    config = small_config(tmp_path, optim=optim, weight_decay=0.01)
    ours, theirs = _params(), _params()
    opt = make_optimizer(ours, config, 1e-2, CPU)
    ref = torch.optim.AdamW(theirs, lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01,
                            **({"fused": True} if optim == "adamw_torch_fused" else {}))
    assert opt.defaults["fused"] == (optim == "adamw_torch_fused" or None)
    for step in range(3):
        for a, b in zip(ours, theirs):
            a.grad = b.grad = torch.randn(a.shape, generator=torch.Generator().manual_seed(step))
        opt.step()
        ref.step()
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_8bit_adamw_tracks_32bit_adamw(tmp_path):
    """bitsandbytes' 8-bit AdamW: uint8 moments for tensors of >= 4096 elements (32-bit below); its states are a
    lossy quantization, so the parameters follow 32-bit AdamW's only approximately: here the gap is 2% of the
    distance moved, bounded at a tenth, and not zero (the states really are 8-bit)."""
    config = small_config(tmp_path, optim="adamw_8bit")
    ours, theirs = _params(), _params()
    opt = make_optimizer(ours, config, 1e-3, CPU)
    ref = torch.optim.AdamW(theirs, lr=1e-3, betas=(0.9, 0.99))
    start = ours[0].detach().clone()
    for step in range(5):
        for a, b in zip(ours, theirs):
            a.grad = b.grad = torch.randn(a.shape, generator=torch.Generator().manual_seed(step))
        opt.step()
        ref.step()
    assert opt.state[ours[0]]["state1"].dtype == torch.uint8 and opt.state[ours[1]]["state1"].dtype == torch.float32
    moved, gap = (theirs[0] - start).abs().mean().item(), (ours[0] - theirs[0]).abs().mean().item()
    assert gap < 0.1 * moved and not torch.equal(ours[0], theirs[0])


def test_8bit_full_fine_tune_keeps_the_embedding_32bit(tmp_path):
    run = setup(small_config(tmp_path, optim="adamw_8bit"))
    embedding = run.model.get_input_embeddings().weight
    big = next(p for n, p in run.model.named_parameters() if "mlp.up_proj" in n)
    from grpo_fast.train.trainer import train_step

    train_step(run)
    assert run.optimizer.state[embedding]["state1"].dtype == torch.float32  # transformers' override
    assert run.optimizer.state[big]["state1"].dtype == torch.uint8


def test_8bit_overrides_stay_with_their_optimizer(tmp_path):
    """transformers' embedding override lives in bitsandbytes' process-wide manager, keyed by parameter index: a later
    optimizer in the same process (its index 0 a large matrix) must still get 8-bit states."""
    run = setup(small_config(tmp_path, optim="adamw_8bit"))  # the embedding is its parameter 0, kept 32-bit
    from grpo_fast.train.trainer import train_step

    train_step(run)
    params = _params()
    optimizer = make_optimizer(params, small_config(tmp_path, optim="adamw_8bit"), 1e-3, CPU)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    assert optimizer.state[params[0]]["state1"].dtype == torch.uint8


# --------------------------------------------------------------------------------------------- refusals


def test_4bit_needs_lora(tmp_path, capsys):
    assert main(["train", "--load-in-4bit", "--output-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--load-in-4bit needs LoRA (lora_r > 0)" in err and "--lora-r R" in err and "got lora_r=0" in err


def test_4bit_without_bitsandbytes(tmp_path, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import bitsandbytes raises ImportError
    assert main(["train", "--load-in-4bit", "--lora-r", "4", "--output-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--load-in-4bit needs bitsandbytes >= 0.50, which is not installed" in err
    assert "pip install 'grpo-fast[quant]'" in err


def test_8bit_optimizer_without_bitsandbytes(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    with pytest.raises(ImportError, match=r"^TrainConfig\.optim adamw_8bit needs bitsandbytes"):
        make_optimizer(_params(), small_config(tmp_path, optim="adamw_8bit"), 1e-3, CPU)


def test_quantized_lm_head_is_refused(quantized):
    model, _, _ = quantized
    broken = copy.deepcopy(model)
    head = bnb.nn.Linear4bit(broken.config.hidden_size, broken.config.vocab_size, bias=False,
                             compute_dtype=torch.float32, quant_type="nf4")
    head.weight = bnb.nn.Params4bit(torch.randn(broken.config.vocab_size, broken.config.hidden_size),
                                    requires_grad=False, quant_type="nf4")
    head = head.to("cpu")  # quantizes the weight
    broken.lm_head = head
    with pytest.raises(ValueError, match=r"^TrainConfig\.load_in_4bit: Qwen2ForCausalLM's lm_head \(Linear4bit\) was "
                                         r"quantized \(weight dtype torch\.uint8\); the fused loss needs"):
        check_4bit_head(broken)
    check_4bit_head(model)  # the loader's own model passes


def test_4bit_under_fsdp2_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(dist_, "init", lambda strategy, device: dist_.World(rank=0, size=2, strategy="fsdp2"))
    with pytest.raises(ValueError, match=r"^TrainConfig\.load_in_4bit: a 4-bit base under FSDP2 is not supported .* "
                                         r"one process or under --distributed ddp"):
        setup(small_config(tmp_path, **QLORA, prompts_per_step=4, distributed="fsdp2"))
    with pytest.raises(ValueError, match=r"^TrainConfig\.optim: adamw_8bit under FSDP2 is not supported"):
        setup(small_config(tmp_path, optim="adamw_8bit", prompts_per_step=4, distributed="fsdp2"))


def test_paged_optimizer_needs_cuda(tmp_path, capsys):
    assert main(["train", "--optim", "paged_adamw_8bit", "--device", "cpu", "--steps", "1",
                 "--output-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--optim: paged_adamw_8bit pages its states through CUDA unified memory, so it needs a CUDA device, got " \
           "cpu; use adamw_8bit" in err
    assert not (tmp_path / "run").exists()


def test_unknown_optimizer_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"TrainConfig\.optim must be one of adamw_torch_fused, adamw_torch, "
                                         r"adamw_8bit, paged_adamw_8bit, paged_adamw_32bit; got 'adam'"):
        small_config(tmp_path, optim="adam")
