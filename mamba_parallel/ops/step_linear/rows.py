"""How many rows (a decode batch) the fused step kernels take; larger batches keep the unfused ops (cuBLAS GEMMs).

Every column block of the kernel reads its rows' whole inputs (hidden state and fp32 residual: 6 bytes a channel),
next to its share of the weight: cheap for a few rows, a multiple of the weight's bytes for tens of rows.
"""

STEP_ROWS = 4
