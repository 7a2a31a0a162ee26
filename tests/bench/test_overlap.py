"""The collective / compute overlap of a profiled step (bench/overlap.py) on synthetic Chrome traces with known
answers; the CPU trace of a real tensor-parallel step runs in test_two_gpu_script.py."""

import pytest

from mamba_parallel.bench.overlap import collective_kind, collective_overlap, covered, markdown, merge


def kernel(name, ts, dur, stream, device=0):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "pid": device, "tid": stream,
            "args": {"device": device, "stream": stream}}


@pytest.mark.parametrize("name, kind", [
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "all_gather"),
    ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "reduce_scatter"),
    ("ncclKernel_AllReduce_RING_LL_Sum_float(ncclWorkElem)", "all_reduce"),
    ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "send_recv"),
    ("ncclDevKernel_Broadcast_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "broadcast"),
    ("c10d::_reduce_scatter_base_", "reduce_scatter"), ("c10d::_allgather_base_", "all_gather"),
    ("c10d::allreduce_", "all_reduce"), ("ncclDevKernel_Generic_4", "other"),
])
def test_collective_kind(name, kind):
    assert collective_kind(name) == kind


def test_merge_and_covered():
    m = merge([(5, 7), (0, 2), (1, 3), (9, 9), (6, 8)])
    assert m == [(0, 3), (5, 8)]
    assert covered(2, 6, m) == 2  # [2, 3) + [5, 6)
    assert covered(3, 5, m) == 0 and covered(-10, 10, m) == 6 and covered(7.5, 100, m) == 0.5


def test_overlap_counts_compute_on_other_streams_of_the_same_gpu_only():
    events = [
        kernel("ncclDevKernel_AllGather_RING_LL", 0, 100, stream=20),   # 60 of its 100 us under compute (other stream)
        kernel("nvjet_gemm", 10, 30, stream=7),
        kernel("_scan_fwd_kernel", 30, 40, stream=7),                    # overlaps the gemm: the union counts once
        kernel("triton_norm_kernel", 0, 100, stream=20),                 # its own stream: serialised, never overlap
        kernel("nvjet_gemm", 0, 100, stream=7, device=1),                # another GPU: no overlap
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 0, "dur": 100, "pid": 0, "tid": 8,
         "args": {"device": 0, "stream": 8}},                            # a copy is not compute
        kernel("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 200, 50, stream=20),  # nothing beside it
        kernel("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", 300, 50, stream=20),
        kernel("elementwise_kernel", 320, 100, stream=7),                # covers 30 of the second reduce-scatter
        {"ph": "X", "cat": "cpu_op", "name": "c10d::allreduce_", "ts": 0, "dur": 500, "pid": 1, "tid": 1},
    ]
    r = collective_overlap(events, steps=2)
    kinds = {k["kind"]: k for k in r["kinds"]}
    assert set(kinds) == {"all_gather", "reduce_scatter"}  # GPU mode reads kernels only
    ag, rs = kinds["all_gather"], kinds["reduce_scatter"]
    assert ag["calls_per_step"] == 0.5 and ag["ms_per_step"] == pytest.approx(0.05)
    assert ag["overlapped_ms_per_step"] == pytest.approx(0.03) and ag["overlap_fraction"] == pytest.approx(0.6)
    assert rs["calls_per_step"] == 1 and rs["ms_per_step"] == pytest.approx(0.05)
    assert rs["overlap_fraction"] == pytest.approx(30 / 100)
    assert r["overlap_fraction"] == pytest.approx(90 / 200) and r["total_ms_per_step"] == pytest.approx(0.1)
    table = markdown([r, r])
    assert "| all_gather | 0 | 0.5 | 0.050 | 0.030 | 60.0% |" in table and "| all | 1 |" in table


def test_cpu_lanes_leave_gloo_worker_threads_out_of_compute():
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "c10d::_allgather_base_", "ts": 0, "dur": 10, "pid": 1, "tid": 1},
        {"ph": "X", "cat": "user_annotation", "name": "gloo:all_gather", "ts": 0, "dur": 10, "pid": 1, "tid": 2},
        {"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": 0, "dur": 10, "pid": 1, "tid": 2},  # gloo's own
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 5, "dur": 10, "pid": 1, "tid": 3},     # real compute
    ]
    r = collective_overlap(events, lanes="cpu")
    (ag,) = r["kinds"]
    assert ag["kind"] == "all_gather" and ag["overlap_fraction"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="lanes"):
        collective_overlap(events, lanes="tpu")
    assert collective_overlap([], steps=3)["kinds"] == [] and collective_overlap([])["overlap_fraction"] is None
