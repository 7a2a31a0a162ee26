"""The selective scan's launch choice (ops/selective_scan/launch.py) for the shapes the benchmarks, the training
presets and generation use, on an H200 (132 SMs): each row pins the launch these shapes are timed with
(docs/kernels/selective_scan.md: kernel path, tiles, warps, pipeline stages). Pure Python, no kernel."""

import pytest

from mamba_parallel.ops.selective_scan import launch

H200_SMS = 132
RPT, TWO, LOOP, GEN, GEN2 = (launch.ROW_PER_THREAD, launch.TWO_ROWS_PER_CHANNEL, launch.TWO_ROWS_STATE_LOOP,
                             launch.GENERIC, launch.GENERIC_TWO_ROWS)

# one row per channel (row-per-thread layout, state loop of 4 states, 2 stages) / its backward (2 states, 3 stages)
RPT_FWD = dict(path=RPT, rows=1, row_layout=True, block_d=32, num_warps=1, unroll=4, stages=2, unrolled_states=0,
               prefetch=0, maxnreg=None)
RPT_BWD = dict(path=RPT, rows=1, row_layout=True, block_d=32, num_warps=1, unroll=2, stages=3, unrolled_states=0,
               prefetch=0, maxnreg=None)
# two rows per channel, states unrolled, L2 prefetch two chunks ahead, 168 registers
TWO_FWD = dict(path=TWO, rows=2, row_layout=True, block_d=64, num_warps=4, unrolled_states=16, prefetch=2,
               maxnreg=168)
GEN2_FWD = dict(path=GEN2, rows=2, row_layout=False, block_d=64, num_warps=4, unroll=1, stages=1, unrolled_states=0)
GEN_FWD = dict(path=GEN, rows=1, row_layout=False, block_d=32, num_warps=1, unroll=1, stages=1, unrolled_states=0)
GEN_BWD = dict(GEN_FWD)


def shape(b, d, L, n=16, groups=1, elem=2, row_layout=True, varlen=False):
    return launch.ScanShape(batch=b, d=d, n=n, groups=groups, seqlen=L, elem_size=elem, row_layout=row_layout,
                            varlen=varlen)


# (what, shape, expected forward, expected backward); chunk 16 tokens as bf16 vectors of 8 unless said
CASES = [
    ("bench b8 d4096 L4096", shape(8, 4096, 4096), RPT_FWD, RPT_BWD),
    ("bench b4 d5120 L8192", shape(4, 5120, 8192), TWO_FWD, RPT_BWD),
    ("bench b8 d4096 L4096 fp32", shape(8, 4096, 4096, elem=4), dict(RPT_FWD, vec=4), dict(RPT_BWD, vec=4)),
    ("train mamba-130m b8 L2048", shape(8, 1536, 2048), TWO_FWD, RPT_BWD),
    ("train mamba-370m", shape(8, 2048, 2048), TWO_FWD, RPT_BWD),
    ("train mamba-790m", shape(8, 3072, 2048), TWO_FWD, RPT_BWD),
    ("train mamba-1.4b", shape(8, 4096, 2048), RPT_FWD, RPT_BWD),
    ("train mamba-2.8b", shape(8, 5120, 2048), RPT_FWD, RPT_BWD),
    ("train mamba-1.4b tp2", shape(8, 2048, 2048), TWO_FWD, RPT_BWD),
    ("train mamba-2.8b tp2", shape(8, 2560, 2048), TWO_FWD, RPT_BWD),
    ("train mamba-130m tp8", shape(8, 192, 2048), TWO_FWD, RPT_BWD),
    ("prefill b1 d1536 L256", shape(1, 1536, 256), TWO_FWD, RPT_BWD),
    ("prefill b1 d5120 L37 (no row-per-thread layout)", shape(1, 5120, 37, row_layout=False), GEN2_FWD, GEN_BWD),
    ("unaligned / channels-last b2 d1536", shape(2, 1536, 700, row_layout=False), GEN2_FWD, GEN_BWD),
    ("channels-last b8 d4096", shape(8, 4096, 704, row_layout=False), GEN_FWD, GEN_BWD),
    ("n 32 b1 d256", shape(1, 256, 704, n=32), dict(path=LOOP, rows=2, row_layout=True, block_d=64, num_warps=4,
                                                     unroll=2, stages=2, unrolled_states=0), RPT_BWD),
    ("d 96 b2 (d % 64 != 0)", shape(2, 96, 704), dict(GEN2_FWD, block_d=32), RPT_BWD),
    ("cu_seqlens b1 d1536", shape(1, 1536, 704, varlen=True), GEN_FWD, GEN_BWD),
    ("odd n 15 b2 d1536", shape(2, 1536, 704, n=15), dict(RPT_FWD, unroll=1), dict(RPT_BWD, unroll=1)),
    ("short L5 b2 d1536", shape(2, 1536, 5, row_layout=False), dict(GEN2_FWD, chunk=8, vec=8),
     dict(GEN_BWD, chunk=8, vec=8)),
    ("groups 2 b2 d1536", shape(2, 1536, 704, groups=2), TWO_FWD, RPT_BWD),
]


@pytest.mark.parametrize("what,s,fwd,bwd", CASES, ids=[c[0] for c in CASES])
def test_h200_launches(what, s, fwd, bwd):
    p = launch.plan(s, H200_SMS)
    for run, want in ((p.fwd, fwd), (p.bwd, bwd)):
        want = dict(dict(chunk=16, vec=8, emulate=False), **want)
        got = {k: getattr(run, k) for k in want}
        assert got == want, (what, run)
    # what the forward ran plans the same launches again: the backward's view of it
    assert launch.plan(s, H200_SMS, p.fwd.path) == p


def test_training_forward_gates_inside_the_scan_on_one_row_per_channel():
    """The fused Mamba-1 layer's forward: the scan writes y * silu(z) on one row per channel (mamba-1.4b / 2.8b),
    a gate kernel follows on two rows (mamba-130m / 370m), as the training-step profiles showed faster."""
    gates = {what: launch.gates_in_forward(launch.plan(s, H200_SMS).fwd.path) for what, s, _, _ in CASES}
    assert gates["train mamba-1.4b"] and gates["train mamba-2.8b"] and gates["cu_seqlens b1 d1536"]
    assert not gates["train mamba-130m b8 L2048"] and not gates["train mamba-370m"]
    assert not gates["unaligned / channels-last b2 d1536"]  # two rows of generic code
    assert launch.gates_in_forward(launch.plan(shape(2, 1536, 704), None).fwd.path)  # the interpreter: generic


def test_two_rows_below_six_warps_per_sm():
    """The switch: one row per channel gives one warp per 32 channels x batch; two rows below 6 per SM."""
    sms = H200_SMS
    edge = 6 * sms * 32  # channels x batch at exactly 6 warps per SM
    assert launch.default_request(1, edge - 32, 16, False, sms) == TWO
    assert launch.default_request(1, edge, 16, False, sms) == RPT
    assert launch.default_request(1, 64, 15, False, sms) == RPT  # odd n: the states do not split in two
    assert launch.default_request(1, 64, 16, True, sms) == RPT  # cu_seqlens
    assert launch.default_request(1, 64, 16, False, None) == GEN  # the interpreter


def test_interpreter_tiles():
    """The interpreter: small generic tiles (chunk 8, vectors of 4, up to 16 channels and at least two channel
    blocks where d allows), the row-per-thread paths only when asked for (one warp of 32 rows, shuffles
    emulated)."""
    s = shape(2, 32, 19, n=4, elem=4)
    p = launch.plan(s, None)
    assert (p.fwd.path, p.fwd.block_d, p.fwd.chunk, p.fwd.vec, p.fwd.emulate) == (GEN, 16, 8, 4, False)
    assert (p.bwd.path, p.bwd.block_d) == (GEN, 16)
    for d, block in ((8, 4), (6, 2), (128, 16)):
        p = launch.plan(shape(2, d, 19, n=4, elem=4), None)
        assert (p.fwd.block_d, p.bwd.block_d) == (block, block)
    p = launch.plan(s, None, TWO)
    assert (p.fwd.path, p.fwd.rows, p.fwd.block_d, p.fwd.unrolled_states, p.fwd.prefetch, p.fwd.maxnreg,
            p.fwd.emulate) == (TWO, 2, 16, 4, 0, None, True)
    assert (p.bwd.path, p.bwd.block_d, p.bwd.stages, p.bwd.emulate) == (RPT, 32, 3, True)
    assert launch.plan(shape(2, 32, 19, row_layout=False), None, RPT).fwd.path == GEN


@pytest.mark.parametrize("b,d,L,segments", [
    (8, 1536, 2048, 8),   # mamba-130m's training step: 0.36 waves of one-piece programs
    (8, 2048, 2048, 2),   # mamba-370m: 0.48 waves, two segments make one
    (8, 4096, 2048, 1),   # mamba-1.4b: 0.97 waves already
    (8, 5120, 2048, 4),   # mamba-2.8b: 1.2 waves, four segments make 4.8
    (8, 4096, 4096, 1),
    (4, 5120, 8192, 3),
    (1, 768, 100, 1),     # 7 chunks: shorter than one segment's minimum
])
def test_backward_segments_by_waves(b, d, L, segments):
    """The backward's segment count: what the wave model of launch.py picks for the training and benchmark
    shapes on 132 SMs (16-token chunks)."""
    nchunks = -(-L // 16)
    assert -(-nchunks // launch.backward_segment_chunks(b, d, nchunks, 1, H200_SMS)) == segments


def test_backward_segments_do_not_move_with_the_states_recompute():
    """On a GPU segments are whole units of the ``states`` recompute's checkpoint group, so one checkpoint per
    chunk and one per group split the walk alike (the recompute stays bit for bit)."""
    from mamba_parallel.layers.recompute import SCAN_CHECKPOINT_EVERY

    assert launch.BWD_MIN_SEGMENT_CHUNKS % SCAN_CHECKPOINT_EVERY == 0
    for b, d, L in [(8, 1536, 2048), (8, 5120, 2048), (4, 5120, 8192), (1, 1536, 1000), (2, 768, 300)]:
        nchunks = -(-L // 16)
        assert (launch.backward_segment_chunks(b, d, nchunks, 1, H200_SMS)
                == launch.backward_segment_chunks(b, d, nchunks, SCAN_CHECKPOINT_EVERY, H200_SMS)), (b, d, L)


def test_backward_segments_whole_groups():
    """Segments hold whole checkpoint groups (the last may be short), never more segments than groups; the
    interpreter takes two so that every CPU test crosses a segment; a count below one is refused."""
    assert launch.backward_segment_chunks(8, 1536, 128, 8, H200_SMS) == 16  # 8 segments of 2 groups of 8
    assert launch.backward_segment_chunks(8, 1536, 128, 16, H200_SMS, segments=3) == 48  # 3 groups each, 2 last
    assert launch.backward_segment_chunks(2, 8, 5, 4, None) == 4  # 2 groups: one each
    assert launch.backward_segment_chunks(2, 8, 5, 1, None) == 3
    assert launch.backward_segment_chunks(2, 8, 5, 8, None) == 8  # one group: one segment
    assert launch.backward_segment_chunks(2, 8, 5, 1, None, segments=99) == 1
    with pytest.raises(ValueError, match="segments=0"):
        launch.backward_segment_chunks(2, 8, 5, 1, None, segments=0)
