"""tools/ncu_kernels.py: ncu's raw CSV page -> one Markdown row per kernel launch (the run side needs a GPU and ncu)."""

import importlib.util
import os

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "ncu_kernels.py")
_spec = importlib.util.spec_from_file_location("ncu_kernels", _PATH)
ncu_kernels = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ncu_kernels)

HEADER = ('"ID","Kernel Name","gpu__time_duration.sum","sm__throughput.avg.pct_of_peak_sustained_elapsed",'
          '"gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed","sm__warps_active.avg.pct_of_peak_sustained_active",'
          '"launch__registers_per_thread","smsp__average_warp_latency_per_inst_issued.ratio",'
          '"smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",'
          '"smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio"')
UNITS = '"","","nsecond","%","%","%","register/thread","",""," "'
CSV = "\n".join([
    "the program's own output comes first", HEADER, UNITS,
    '"0","_scan_fwd_kernel","778,304","51.88","26.66","18.40","126","5.61","1.2","0.7"',
    '"1","void at::native::vectorized_elementwise_kernel<8>","82,752","14.5","88.7","24.6","16","43.4","2.3","0.1"',
])


def test_table_one_row_per_launch_of_our_kernels():
    md = ncu_kernels.table(CSV).splitlines()
    assert md[0].startswith("| kernel | µs | SM % | DRAM %")
    assert len(md) == 3  # header, rule, the one kernel that is not torch's own
    assert md[2] == "| `_scan_fwd_kernel` | 778.3 | 51.88 | 26.66 | 18.4 | 126 | 5.61 | wait 1.2, long_scoreboard 0.7 |"
    assert len(ncu_kernels.table(CSV, keep_all=True).splitlines()) == 4


def test_table_without_ncu_csv_names_the_cause():
    with pytest.raises(SystemExit, match="--csv --page raw"):
        ncu_kernels.table("no csv here\n")


def test_run_checks_the_shape_length():
    with pytest.raises(SystemExit):
        ncu_kernels.main(["run", "ssd", "--shape", "1", "2", "3"])
