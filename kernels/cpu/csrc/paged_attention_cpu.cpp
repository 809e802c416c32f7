// Paged attention for short query runs on the CPU: decode steps (one query token per sequence)
// and speculative verification (k + 1 tokens), read straight from the block pool.
//
// Why native code: the PyTorch reference first gathers every sequence's KV tiles into a padded
// contiguous buffer and then runs scaled_dot_product_attention over it, so each step moves the
// whole context through memory three times (read, write, read) and pads it. Decode attention is
// memory-bound (a few flops per byte), so reading the tiles once in place is what matters.
//
// Layouts (as kernels/reference.py documents them):
//   q, out:            [num_tokens, num_heads, head_dim]
//   k_cache, v_cache:  [num_blocks, num_kv_heads, block_size, head_dim]  (a (block, kv head) tile is contiguous)
//   block_tables:      [num_seqs, max_blocks] int32
//   seq_lens:          [num_seqs] int32       context length including this step's tokens
//   query_start_loc:   [num_seqs + 1] int32   rows of q owned by each sequence
//   seq_indices:       [n] int64              the sequences this call computes (the others are left alone)
// Query row r of a sequence with query_len Q and context L sees positions 0 .. L - Q + r.
// Query head h reads KV head h / (num_heads / num_kv_heads) (transformers' repeat_kv).
// Per-layer options (0 = off):
//   window:   sliding window: row r sees only positions j with L - Q + r - window < j <= L - Q + r;
//             the blocks wholly before every row's window are never read.
//   softcap:  the scaled logits s become softcap * tanh(s / softcap) before the softmax (Gemma 2).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "vec_avx2.h"

namespace {

#ifdef FERRY_AVX2
using ferry::exp8;
using ferry::hsum8;
#endif

template <typename scalar_t>
inline float dot(const float* q, const scalar_t* k, int64_t dim) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < dim; ++d) sum += q[d] * static_cast<float>(k[d]);
  return sum;
}

template <typename scalar_t>
inline void axpy(float* acc, float p, const scalar_t* v, int64_t dim) {
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) acc[d] += p * static_cast<float>(v[d]);
}

// Gemma 2's logit soft-capping on one block's scores, in place; returns their new max.
inline float apply_softcap(float* scores, int64_t n, float softcap) {
  float block_max = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < n; ++t) {
    scores[t] = softcap * std::tanh(scores[t] / softcap);
    block_max = std::max(block_max, scores[t]);
  }
  return block_max;
}

#ifdef FERRY_AVX2
// One block for one query (float32, head_dim = 8 * CHUNKS): scores, online-softmax update, P V.
// The query and the output accumulator live in registers across the block, and every token's
// FMAs go to independent accumulators (a single accumulator chain would wait on FMA latency).
// scores has room for block_size rounded up to 8.
template <int CHUNKS>
inline void block_update_avx2(const float* qi, const float* k_tile, const float* v_tile, int64_t visible,
                              float softcap, float* scores, float& row_max, float& row_sum, float* acc) {
  constexpr int64_t head_dim = 8 * CHUNKS;
  __m256 q[CHUNKS];
  for (int c = 0; c < CHUNKS; ++c) q[c] = _mm256_loadu_ps(qi + 8 * c);
  float block_max = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < visible; ++t) {
    const float* k = k_tile + t * head_dim;
    __m256 s0 = _mm256_mul_ps(q[0], _mm256_loadu_ps(k));
    __m256 s1 = _mm256_setzero_ps();
    for (int c = 1; c < CHUNKS; ++c) {
      if (c % 2) s1 = _mm256_fmadd_ps(q[c], _mm256_loadu_ps(k + 8 * c), s1);
      else s0 = _mm256_fmadd_ps(q[c], _mm256_loadu_ps(k + 8 * c), s0);
    }
    scores[t] = hsum8(_mm256_add_ps(s0, s1));
    block_max = std::max(block_max, scores[t]);
  }
  if (softcap > 0.f) block_max = apply_softcap(scores, visible, softcap);
  const float new_max = std::max(row_max, block_max);
  __m256 a[CHUNKS];
  for (int c = 0; c < CHUNKS; ++c) a[c] = _mm256_loadu_ps(acc + 8 * c);
  if (new_max > row_max) {
    const float correction = std::exp(row_max - new_max);  // exp(-inf) = 0 on the first block
    row_sum *= correction;
    const __m256 scale = _mm256_set1_ps(correction);
    for (int c = 0; c < CHUNKS; ++c) a[c] = _mm256_mul_ps(a[c], scale);
    row_max = new_max;
  }
  const int64_t padded = (visible + 7) / 8 * 8;
  for (int64_t t = visible; t < padded; ++t) scores[t] = -std::numeric_limits<float>::infinity();
  const __m256 m = _mm256_set1_ps(new_max);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t t = 0; t < padded; t += 8) {
    const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + t), m));
    _mm256_storeu_ps(scores + t, p);
    sum = _mm256_add_ps(sum, p);
  }
  row_sum += hsum8(sum);
  for (int64_t t = 0; t < visible; ++t) {
    const __m256 p = _mm256_set1_ps(scores[t]);
    const float* v = v_tile + t * head_dim;
    for (int c = 0; c < CHUNKS; ++c) a[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * c), a[c]);
  }
  for (int c = 0; c < CHUNKS; ++c) _mm256_storeu_ps(acc + 8 * c, a[c]);
}

// The head dims the register-resident path covers; others take the portable loop.
inline bool block_update_fast(const float* qi, const float* k_tile, const float* v_tile, int64_t visible,
                              int64_t head_dim, float softcap, float* scores, float& row_max, float& row_sum,
                              float* acc) {
  switch (head_dim) {
    case 32: block_update_avx2<4>(qi, k_tile, v_tile, visible, softcap, scores, row_max, row_sum, acc); return true;
    case 64: block_update_avx2<8>(qi, k_tile, v_tile, visible, softcap, scores, row_max, row_sum, acc); return true;
    case 128:
      block_update_avx2<16>(qi, k_tile, v_tile, visible, softcap, scores, row_max, row_sum, acc);
      return true;
    default: return false;
  }
}
#endif

template <typename scalar_t>
void attend(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
            const torch::Tensor& block_tables, const torch::Tensor& seq_lens, const torch::Tensor& query_start_loc,
            const torch::Tensor& seq_indices, double scale, int64_t window, double softcap, torch::Tensor& out) {
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t q_row_stride = q.stride(0);  // q may be a row-strided view into the fused qkv output
  const int64_t num_kv_heads = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t table_stride = block_tables.size(1);
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const scalar_t* k_ptr = k_cache.data_ptr<scalar_t>();
  const scalar_t* v_ptr = v_cache.data_ptr<scalar_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int64_t* seqs = seq_indices.data_ptr<int64_t>();
  // Where query i of a (sequence, KV head) writes: row first_row + i / group, head kv_head * group + i % group.
  const auto out_row = [&](int64_t first_row, int64_t kv_head, int64_t i) {
    return out_ptr + ((first_row + i / group) * num_heads + kv_head * group + i % group) * head_dim;
  };
  const int64_t tile = block_size * head_dim;
  const float fscale = static_cast<float>(scale);
  const float fsoftcap = static_cast<float>(softcap);
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // One work item = one (sequence, KV head, range of its blocks): the query heads of a KV head
  // share every K/V row it loads. With fewer (sequence, KV head) pairs than twice the threads
  // (batch 1 to a few), each pair's blocks are split into `parts` ranges so every core has work;
  // each range keeps its own online-softmax state (max, sum, unnormalised output), and the
  // ranges are merged after the parallel loop, rescaled to the common max (flash-decoding).
  const int64_t num_pairs = seq_indices.size(0) * num_kv_heads;
  const int64_t threads = at::get_num_threads();
  // With a window, a sequence's walk starts at the block holding its first query row's oldest
  // visible position: everything before is outside every row's window and never read.
  const auto first_block = [&](int64_t seq) -> int64_t {
    if (window <= 0) return 0;
    return std::max<int64_t>(0, lens[seq] - (starts[seq + 1] - starts[seq]) - window + 1) / block_size;
  };
  int64_t max_blocks = 0, max_query_len = 0;
  for (int64_t s = 0; s < seq_indices.size(0); ++s) {
    max_blocks = std::max<int64_t>(max_blocks, (lens[seqs[s]] + block_size - 1) / block_size - first_block(seqs[s]));
    max_query_len = std::max<int64_t>(max_query_len, starts[seqs[s] + 1] - starts[seqs[s]]);
  }
  constexpr int64_t kMinBlocksPerPart = 4;  // below this a range's fixed costs outweigh the balance
  const int64_t parts = num_pairs >= 2 * threads
                            ? 1
                            : std::max<int64_t>(1, std::min((2 * threads + num_pairs - 1) / num_pairs,
                                                            max_blocks / kMinBlocksPerPart));
  const int64_t max_queries = max_query_len * group;
  const int64_t state = head_dim + 2;  // per query of a range: output[head_dim], max, sum
  std::vector<float> partial(parts > 1 ? num_pairs * parts * max_queries * state : 0);

  at::parallel_for(0, num_pairs * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> queries, acc, row_max, row_sum, scores;
    // Work item w's sequence, KV head and blocks [b_begin, b_end).
    const auto item = [&](int64_t w, int64_t& seq, int64_t& kv_head, int64_t& b_begin, int64_t& b_end) {
      const int64_t pair = w / parts, part = w % parts;
      seq = seqs[pair / num_kv_heads], kv_head = pair % num_kv_heads;
      const int64_t num_blocks = (lens[seq] + block_size - 1) / block_size, b_first = first_block(seq);
      const int64_t per_part = (num_blocks - b_first + parts - 1) / parts;
      b_begin = std::min(num_blocks, b_first + part * per_part);
      b_end = std::min(num_blocks, b_begin + per_part);
    };
    for (int64_t w = begin; w < end; ++w) {
      int64_t seq, kv_head, b_begin, b_end;
      item(w, seq, kv_head, b_begin, b_end);
      const int64_t first_row = starts[seq], query_len = starts[seq + 1] - first_row, context = lens[seq];
      const int64_t num_queries = query_len * group;  // query i = (row i / group, head kv_head * group + i % group)
      queries.resize(num_queries * head_dim);
      acc.assign(num_queries * head_dim, 0.f);
      row_max.assign(num_queries, neg_inf);
      row_sum.assign(num_queries, 0.f);
      scores.resize((block_size + 7) / 8 * 8);
      for (int64_t i = 0; i < num_queries; ++i) {
        const scalar_t* src = q_ptr + (first_row + i / group) * q_row_stride + (kv_head * group + i % group) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) queries[i * head_dim + d] = static_cast<float>(src[d]) * fscale;
      }
      for (int64_t b = b_begin; b < b_end; ++b) {
        const int64_t block = tables[seq * table_stride + b];
        const scalar_t* k_tile = k_ptr + (block * num_kv_heads + kv_head) * tile;
        const scalar_t* v_tile = v_ptr + (block * num_kv_heads + kv_head) * tile;
        const int64_t block_start = b * block_size;
        // The next tiles are elsewhere in the pool (no stride for the hardware prefetcher to find):
        // ask for them into L2 while this block computes, a share before each query's pass over it.
        // Asked for all at once into L1, the lines stalled on the core's fill buffers (27% of this
        // kernel's samples sat on the prefetch): 32 sequences x 150 tokens x 30 layers (SmolLM2,
        // float32 KV, 236 MB) took 14-15 ms; spread into L2, 10.7-11.4 ms; with an item's last block
        // asking for the next item's first, 9.2-9.9 ms (4.4 ms when the KV is cache-resident, 7.4 ms
        // the streaming-read floor).
        [[maybe_unused]] const char* k_next = nullptr;
        [[maybe_unused]] const char* v_next = nullptr;
        // The next tiles: this item's next block, or after its last the next item's first.
        int64_t next_seq = seq, next_head = kv_head, next_block = b + 1, next_end = b_end;
        if (next_block >= b_end && w + 1 < end) item(w + 1, next_seq, next_head, next_block, next_end);
        if (next_block < next_end) {
          const int64_t next = tables[next_seq * table_stride + next_block];
          k_next = reinterpret_cast<const char*>(k_ptr + (next * num_kv_heads + next_head) * tile);
          v_next = reinterpret_cast<const char*>(v_ptr + (next * num_kv_heads + next_head) * tile);
        }
        [[maybe_unused]] const int64_t tile_lines = tile * static_cast<int64_t>(sizeof(scalar_t)) / 64;
        for (int64_t i = 0; i < num_queries; ++i) {
#ifdef FERRY_AVX2
          if (k_next) {
            for (int64_t line = i * tile_lines / num_queries; line < (i + 1) * tile_lines / num_queries; ++line) {
              _mm_prefetch(k_next + 64 * line, _MM_HINT_T1);
              _mm_prefetch(v_next + 64 * line, _MM_HINT_T1);
            }
          }
#endif
          // Causal: this query sees context positions up to last_visible.
          const int64_t last_visible = context - query_len + i / group;
          int64_t visible = std::min(block_size, last_visible - block_start + 1);
          if (visible <= 0) continue;
          // Window: the block's first `skip` positions are older than this row's window.
          const int64_t skip = window > 0 ? std::max<int64_t>(0, last_visible - window + 1 - block_start) : 0;
          if (skip >= visible) continue;
          visible -= skip;
          const scalar_t* k_rows = k_tile + skip * head_dim;
          const scalar_t* v_rows = v_tile + skip * head_dim;
          const float* qi = queries.data() + i * head_dim;
          float* acc_i = acc.data() + i * head_dim;
#ifdef FERRY_AVX2
          if constexpr (std::is_same_v<scalar_t, float>) {
            if (block_update_fast(qi, k_rows, v_rows, visible, head_dim, fsoftcap, scores.data(), row_max[i],
                                  row_sum[i], acc_i))
              continue;
          }
#endif
          float block_max = neg_inf;
          for (int64_t t = 0; t < visible; ++t) {
            scores[t] = dot(qi, k_rows + t * head_dim, head_dim);
            block_max = std::max(block_max, scores[t]);
          }
          if (fsoftcap > 0.f) block_max = apply_softcap(scores.data(), visible, fsoftcap);
          // Online softmax: rescale what was accumulated when the running max grows.
          const float new_max = std::max(row_max[i], block_max);
          if (new_max > row_max[i]) {
            const float correction = std::exp(row_max[i] - new_max);  // exp(-inf) = 0 on the first block
            row_sum[i] *= correction;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) acc_i[d] *= correction;
            row_max[i] = new_max;
          }
          for (int64_t t = 0; t < visible; ++t) {
            const float p = std::exp(scores[t] - new_max);
            row_sum[i] += p;
            axpy(acc_i, p, v_rows + t * head_dim, head_dim);
          }
        }
      }
      if (parts > 1) {  // keep this range's state for the merge
        float* dst = partial.data() + w * max_queries * state;
        for (int64_t i = 0; i < num_queries; ++i, dst += state) {
          std::copy(acc.begin() + i * head_dim, acc.begin() + (i + 1) * head_dim, dst);
          dst[head_dim] = row_max[i];
          dst[head_dim + 1] = row_sum[i];
        }
        continue;
      }
      for (int64_t i = 0; i < num_queries; ++i) {
        scalar_t* dst = out_row(first_row, kv_head, i);
        const float inv = 1.f / row_sum[i];
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[i * head_dim + d] * inv);
      }
    }
  });
  if (parts == 1) return;

  // Merge each pair's ranges: o = sum_p e^(m_p - m) acc_p / sum_p e^(m_p - m) l_p with m = max_p m_p
  // (a range that saw no visible token has m_p = -inf and weighs 0).
  at::parallel_for(0, num_pairs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(head_dim);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t seq = seqs[pair / num_kv_heads], kv_head = pair % num_kv_heads;
      const int64_t first_row = starts[seq], num_queries = (starts[seq + 1] - first_row) * group;
      for (int64_t i = 0; i < num_queries; ++i) {
        float m = neg_inf;
        for (int64_t part = 0; part < parts; ++part)
          m = std::max(m, partial[((pair * parts + part) * max_queries + i) * state + head_dim]);
        float total = 0.f;
        std::fill(merged.begin(), merged.end(), 0.f);
        for (int64_t part = 0; part < parts; ++part) {
          const float* st = partial.data() + ((pair * parts + part) * max_queries + i) * state;
          if (st[head_dim] == neg_inf) continue;
          const float weight = std::exp(st[head_dim] - m);
          total += weight * st[head_dim + 1];
          for (int64_t d = 0; d < head_dim; ++d) merged[d] += weight * st[d];
        }
        scalar_t* dst = out_row(first_row, kv_head, i);
        const float inv = 1.f / total;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(merged[d] * inv);
      }
    }
  });
}

}  // namespace

namespace ferry {

void paged_attention_short(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                           const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                           const torch::Tensor& query_start_loc, const torch::Tensor& seq_indices, double scale,
                           torch::Tensor out, int64_t window, double softcap) {
  TORCH_CHECK(!q.is_cuda(), "paged_attention_short runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad q or cache shape");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "q's heads must be contiguous within a row");
  TORCH_CHECK(out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "out and the caches must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && out.scalar_type() == q.scalar_type(),
              "q, out and the caches must share one dtype");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(1) == 0, "head dims or head counts mismatch");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt32 &&
                  query_start_loc.scalar_type() == torch::kInt32 && seq_indices.scalar_type() == torch::kInt64,
              "metadata dtypes: int32 tables, lens and starts; int64 seq_indices");
  TORCH_CHECK(window >= 0 && softcap >= 0.0, "window and softcap must be >= 0 (0 = off)");
  TORCH_CHECK(block_tables.is_contiguous() && seq_indices.is_contiguous(), "metadata must be contiguous");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention_short", [&] {
    attend<scalar_t>(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, seq_indices, scale, window, softcap,
                     out);
  });
}

}  // namespace ferry
