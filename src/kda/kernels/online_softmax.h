// One step of an online (streaming) softmax, for attention kernels that walk a query block's keys block
// by block and never hold a score row over every key (MLA's flash-style prefill). fp32 throughout, as the
// spec's softmax is in every mode. Private to the library and its tests.
//
// For each of the `rows` rows of s [rows, n] (raw scores, masked entries -inf; scale > 0 multiplies each),
// with the row's running max mx, running sum l and output row acc (dv values, the weighted sum of values
// so far):
//
//   s_j <- scale s_j;  m' = max(mx, max_j s_j);  s_j <- exp(s_j - m');  alpha = exp(mx - m');
//   l <- l alpha + sum_j s_j;  acc <- acc alpha;  mx <- m'
//
// exp is exact 0 for masked entries and wherever s_j - m' < -87 (below 2^-125 of the row's largest
// weight, so nothing the sum can hold; the reference's libm expf gives such a tiny value there), and
// alpha is 0 on a row's first block (mx = -inf). A row whose entries and mx are all -inf adds nothing:
// its s is set to 0, its mx, l and acc are left as they were.
#pragma once

#include <cstdint>

namespace kda::kernels {

// The copy for the fastest ISA this CPU runs (vectorised exp, max and sum over each row).
void online_softmax_block(float* s, int64_t n, int64_t rows, float scale, float* mx, float* l, float* acc,
                          int64_t dv);
// The reference: the same step in plain loops with libm's expf.
void online_softmax_block_reference(float* s, int64_t n, int64_t rows, float scale, float* mx, float* l,
                                    float* acc, int64_t dv);

}  // namespace kda::kernels
