"""``--parallel auto``: choose_parallel's documented rule on real presets (no processes needed)."""

import pytest

from mamba_parallel import get_preset
from mamba_parallel.distributed import ParallelConfigError, choose_parallel
from mamba_parallel.distributed.auto import count_params, estimate_memory

GIB = 1024 ** 3


def test_data_parallel_when_it_fits():
    # mamba2-2.7b on two H200s (141 GiB): about 86 GiB per GPU at batch 8 x 2048 with FSDP2 -> pure dp.
    cfg = get_preset("mamba2-2.7b")
    assert choose_parallel(2, cfg, 141 * GIB) == (1, 1)
    assert choose_parallel(1, cfg, 141 * GIB) == (1, 1)


def test_tensor_parallel_when_activations_do_not_fit():
    # On 80 GiB GPUs the same run needs tp=2 (activations halve under TP + SP).
    cfg = get_preset("mamba2-2.7b")
    assert estimate_memory(cfg, 2, tp=1) > 0.85 * 80 * GIB > estimate_memory(cfg, 2, tp=2)
    assert choose_parallel(2, cfg, 80 * GIB) == (2, 1)
    assert choose_parallel(8, cfg, 40 * GIB) == (4, 1)


def test_context_parallel_as_last_resort_and_invalid_tp_skipped():
    cfg = get_preset("mamba-2.8b")
    # 16 GPUs of 16 GiB at 32k tokens per sequence: tp 8 is not enough, cp grows while dp allows.
    tp, cp = choose_parallel(16, cfg, 16 * GIB, seq_len=32768, micro_batch=1)
    assert (tp, cp) == (8, 2)
    # tiny-mamba2 has 8 heads and vocab 256: tp 2/4/8 valid; a 3-GPU world only allows tp 1.
    assert choose_parallel(3, get_preset("tiny-mamba2"), 1024) == (1, 1)
    assert count_params(get_preset("mamba2-130m")) > 100_000_000


def test_bad_arguments_and_unknown_memory():
    with pytest.raises(ParallelConfigError, match="world_size"):
        choose_parallel(0, get_preset("tiny-mamba"), GIB)
    assert choose_parallel(4, get_preset("tiny-mamba"), 0) == (1, 1)  # CPU ranks: memory unknown -> dp
