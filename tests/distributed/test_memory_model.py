"""The memory model of --parallel auto / --batch-size auto (docs/memory-model.md) on meta-device models of every
preset, and plan_layout's order (dp / tp / cp, then pp, then CPU offload, else a refusal naming what it tried)."""

import pytest

from mamba_parallel.config import PRESETS, get_preset
from mamba_parallel.distributed import ParallelConfigError
from mamba_parallel.distributed.auto import (
    BF16_STATE_BYTES_PER_PARAM,
    BYTES_PER_PARAM,
    HEADROOM,
    count_params,
    estimate_memory,
    plan_layout,
)

GIB = 2**30
BIG = dict(n_layer=256)  # mamba2-2.7b's width, four times its depth: ~10.5B parameters


@pytest.mark.parametrize("name", list(PRESETS))
def test_states_term_of_every_preset(name):
    config = get_preset(name)
    n = count_params(config)
    for world in (1, 8):
        e = estimate_memory(config, world, n_params=n, breakdown=True)
        assert e["states"] == pytest.approx(BYTES_PER_PARAM * n / world)
        bf16 = estimate_memory(config, world, n_params=n, param_dtype="bf16", breakdown=True)
        assert bf16["states"] == pytest.approx(BF16_STATE_BYTES_PER_PARAM * n / world)
        off = estimate_memory(config, world, n_params=n, cpu_offload=True, breakdown=True)
        assert off["states"] == 0 and off["host"] == pytest.approx(e["states"])
        ac = estimate_memory(config, world, n_params=n, activation_checkpointing=True, breakdown=True)
        assert ac["activations"] < e["activations"]
        assert e["total"] == pytest.approx(sum(e[k] for k in ("states", "gathered", "activations", "logits")))


def test_the_default_estimate_is_the_documented_formula():
    config = get_preset("mamba2-2.7b")
    n = count_params(config)
    tokens = 8 * 2048
    want = 16 * n / 2 + tokens * (24 * config.d_model * config.n_layer + 8 * config.padded_vocab_size) / 2
    assert estimate_memory(config, 2, tp=2, n_params=n) == int(want)


def test_pipeline_memory_terms():
    config = get_preset("mamba2-1.3b")
    one = estimate_memory(config, 2, breakdown=True)
    pp = estimate_memory(config, 2, pp=2, microbatches=8, breakdown=True)
    assert pp["states"] == one["states"] and pp["gathered"] > 0
    assert pp["activations"] == pytest.approx(one["activations"])  # 1F1B: stage 0 keeps pp micro-batches
    gpipe_like = estimate_memory(config, 2, pp=2, microbatches=1, breakdown=True)
    assert gpipe_like["activations"] == pytest.approx(one["activations"] / 2)


def test_plan_order_and_reason():
    small = plan_layout(2, get_preset("mamba2-1.3b"), 141 * GIB)
    assert (small.tp, small.cp, small.pp, small.cpu_offload) == (1, 1, 1, False) and "fits" in small.reason
    big = get_preset("mamba2-2.7b", **BIG)
    two = plan_layout(2, big, 141 * GIB, micro_batch=2, activation_checkpointing=True, param_dtype="bf16")
    assert two.tp == 2 and two.estimate <= HEADROOM * 141 * GIB
    off = plan_layout(1, big, 141 * GIB, micro_batch=2,
                      activation_checkpointing=True, param_dtype="bf16", host_mem_bytes=512 * GIB,
                      local_world_size=1)
    assert off.cpu_offload and "host memory" in off.reason


def test_refusal_names_each_candidate():
    big = get_preset("mamba2-2.7b", **BIG)
    with pytest.raises(ParallelConfigError) as e:
        plan_layout(4, big, 40 * GIB, micro_batch=8, host_mem_bytes=64 * GIB, local_world_size=4)
    text = str(e.value)
    assert "no layout fits 4 GPU(s)" in text and "pp=2" in text and "cpu offload" in text


def test_unknown_gpu_memory_is_data_parallel():
    plan = plan_layout(4, get_preset("tiny-mamba"), 0)
    assert (plan.tp, plan.cp, plan.pp, plan.cpu_offload) == (1, 1, 1, False)


def test_a_7b_preset_on_one_h200():
    config = get_preset("mamba-codestral-7b")
    bf16 = plan_layout(1, config, 141 * GIB, micro_batch=4, activation_checkpointing=True, param_dtype="bf16",
                       host_mem_bytes=128 * GIB, local_world_size=1)
    assert (bf16.tp, bf16.pp, bf16.cpu_offload) == (1, 1, False), bf16  # 12 bytes x 7.3B fit beside activations
    fp32 = estimate_memory(config, 1, micro_batch=4, activation_checkpointing=True, breakdown=True)
    assert fp32["total"] > HEADROOM * 141 * GIB  # 16 bytes a parameter alone leave no room
    off = estimate_memory(config, 1, micro_batch=4, activation_checkpointing=True, cpu_offload=True,
                          param_dtype="bf16", breakdown=True)
    assert off["total"] < 20 * GIB and 80 * GIB < off["host"] < HEADROOM * 128 * GIB
