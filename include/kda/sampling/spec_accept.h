// Speculative sampling: verifying drafted tokens against the target's distribution so that the tokens
// emitted are distributed exactly as sampling from the target would give them (Leviathan et al. 2023,
// Chen et al. 2023), with recursive rejection over a tree's siblings (SpecInfer's multi-draft rule).
//
// At one row position, p is the target's processed distribution there (RequestSampler::distribution: after
// the penalties, temperature, top-k, top-p, min-p). The drafts at that position (siblings: the children of
// the position in the draft tree) are tried in order against a residual r, starting at r = p: sibling i
// with token x_i, proposed with probability q_i(x_i), is accepted when u_i < r(x_i) / q_i(x_i); on
// rejection r becomes norm(max(0, r - q_i)). When every sibling is rejected (or there is none), the token
// is drawn from the last r. A deterministic drafter (ngram) proposes one-hot q_i: acceptance with
// probability r(x_i), and the residual is r with x_i removed.
//
// Draws: the request's own seeded stream at draw index k (the count of tokens generated before this
// position, as RequestSampler counts them): sibling i's test uses spec_uniform(seed, k, 1 + i), the final
// draw spec_uniform(seed, k, 0) (= draw_uniform(seed, k)). So a seeded request gives the same tokens
// whatever else is batched with it.
#pragma once

#include <cstdint>
#include <span>

namespace kda::sampling {

struct SpecAcceptResult {
  int32_t sibling = -1;  // the accepted sibling's index, or -1: every one rejected
  int32_t token = -1;    // the emitted token: the accepted draft, or the residual's draw
};

// The j-th uniform in [0, 1) of draw index k; j = 0 is draw_uniform(seed, k).
double spec_uniform(uint64_t seed, int64_t k, int32_t j);

// p: [V] the target's probabilities at the position (non-negative, summing to 1 up to rounding); used as
// scratch (its contents are undefined afterwards). drafts: the siblings' tokens (each < V; a tree's are
// distinct, independent draws from general proposals need not be). q: [drafts.size() * V] each sibling's
// proposal distribution, or empty for one-hot proposals (q_i(x_i) = 1). Bad shapes, ids, a negative or NaN
// probability, p with no mass, or q_i(x_i) = 0 -> std::invalid_argument, p untouched.
SpecAcceptResult spec_accept(std::span<double> p, std::span<const int32_t> drafts, std::span<const double> q,
                             uint64_t seed, int64_t k);

// The reference beside it, same signature: the residual materialized and normalized at each step.
SpecAcceptResult spec_accept_reference(std::span<double> p, std::span<const int32_t> drafts,
                                       std::span<const double> q, uint64_t seed, int64_t k);

}  // namespace kda::sampling
