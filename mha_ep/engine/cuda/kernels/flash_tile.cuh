// One key tile's steps as the tensor-core kernels run them (flash_attention.cu's flash_attention_mma,
// flash_attention_wgmma.cu, flash_attention_ws.cu), written once: the mask classification before a tile's
// products, which shortcut of "Work skipped" the tile takes, and steps A and B of the online softmax (the steps of
// flash_attention.cu's header). What the kernels still spell out each (the logits of steps 2-4, step C's
// exponentials, a FLASH_PLAIN tile's classification) changed the PTX nvcc emits when moved here, so it stays put:
// an edit of these pieces is checked with scripts/ptx_identity.py.
//
// The register layout they share: a thread holds query rows g and g + 8 of its warp's 16 (g = lane / 4) and, of
// every block of 8 keys (n8 block i of the tile), keys 8 i + 2 tig and 8 i + 2 tig + 1 (tig = lane % 4): the m16n8
// C layout of mma.sync, which wgmma's accumulators repeat per warp. A tile's scores are s[4 i + c] for n8 block i:
// c = 0, 1 row g, c = 2, 3 row g + 8, key 8 i + 2 tig + (c & 1). (flash_attention_mma's s_acc[np][hf][c] is the
// same order, n8 block 2 np + hf.)
#pragma once
#include "flash_common.cuh"

// ------------------------------------------------------------------------------------------- before the tile
// The causal skip's vote, once a key tile starts at the block's causal frontier (every remaining key is in the
// causal future of every row): true when no row max of the whole block is near float32 lowest, so that the
// remaining logits (x + FLOAT32_LOWEST) give p = 0 exactly and the block may stop (flash_attention.cu's header,
// "Work skipped").
__device__ __forceinline__ bool causal_rest_dominated(const float (&row_max)[2]) {
  return __syncthreads_and(row_max[0] > CAUSAL_SKIP_MAX_FLOOR && row_max[1] > CAUSAL_SKIP_MAX_FLOOR);
}

// How the masks touch key tile [n0, n0 + block_n) of the block's rows from m0 (TileMask), for an instantiation
// with a mask input (FEATURES other than FLASH_PLAIN), classified before the tile's products are issued: with a
// padding mask from its flags (tile_mask), otherwise from the tile's place alone; with key offsets no tile is
// plain (every score takes its key's offset). (A FLASH_PLAIN instantiation classifies after its products.)
template <int FEATURES>
__device__ __forceinline__ void masked_tile_mask(TileMask& tm, const MaskParams& mp, int b, int m0, int n0,
                                                 int block_n, int lane, int total_seq, int causal, int past_seq) {
  constexpr bool WITH_PADDING = (FEATURES & FLASH_WITH_PADDING) != 0;
  constexpr bool WITH_BIAS = (FEATURES & FLASH_WITH_BIAS) != 0;
  constexpr bool WITH_OFFSET = (FEATURES & FLASH_WITH_KEY_OFFSET) != 0;
  if constexpr (WITH_PADDING) {
    tm = tile_mask(mp, b, m0, n0, block_n, lane);
    if constexpr (WITH_OFFSET) tm.plain = false;  // every score takes its key's offset
  } else if constexpr (WITH_BIAS || WITH_OFFSET) {
    tm.in_range = n0 + block_n <= total_seq;
    tm.causal = causal && n0 + block_n - 1 > past_seq + m0;
    tm.padding = TILE_KEEP_ALL;
    tm.plain = false;
  }
}

// Which of the shortcuts of flash_attention.cu's header a key tile takes (scale > 0 for both: max(scale * acc)
// is scale * max(acc) only then): a plain tile keeps its raw products, x = scale * acc folded into step C; a tile
// whose keys are all padded (in range, before every causal frontier, no attention_bias) keeps its raw products
// until its row maxima say whether any p can be nonzero (padded), or with key offsets (not monotonic in acc)
// computes its x like any tile and takes the same vote (padded_exact).
struct TileKind {
  bool plain;
  bool padded;
  bool padded_exact;
};
template <int FEATURES> __device__ __forceinline__ TileKind tile_kind(const TileMask& tm, float scale) {
  constexpr bool WITH_PADDING = (FEATURES & FLASH_WITH_PADDING) != 0;
  constexpr bool WITH_BIAS = (FEATURES & FLASH_WITH_BIAS) != 0;
  constexpr bool WITH_OFFSET = (FEATURES & FLASH_WITH_KEY_OFFSET) != 0;
  TileKind kind;
  kind.plain = tm.plain && scale > 0.0f;
  const bool all_padded = WITH_PADDING && !WITH_BIAS && !tm.plain && tm.in_range && !tm.causal &&
                          tm.padding == TILE_PAD_ALL;
  kind.padded = !WITH_OFFSET && all_padded && scale > 0.0f;
  kind.padded_exact = WITH_OFFSET && all_padded;
  return kind;
}

// ------------------------------------------------------------------------------------- the online softmax
// Step A, first half: the running maxima of the thread's scores of each row, four independent chains over the
// n8 blocks (part_max[r][k] over the blocks i = k mod 4), so no chain of S_BLOCKS dependent steps.
template <int S_BLOCKS>
__device__ __forceinline__ void partial_row_max(const float (&s)[S_BLOCKS * 4], float (&part_max)[2][4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    part_max[0][i] = fmaxf(s[4 * i], s[4 * i + 1]);
    part_max[1][i] = fmaxf(s[4 * i + 2], s[4 * i + 3]);
  }
#pragma unroll
  for (int i = 4; i < S_BLOCKS; ++i) {
    part_max[0][i % 4] = fmaxf(part_max[0][i % 4], fmaxf(s[4 * i], s[4 * i + 1]));
    part_max[1][i % 4] = fmaxf(part_max[1][i % 4], fmaxf(s[4 * i + 2], s[4 * i + 3]));
  }
}

// Step A, second half, and step B for the thread's two rows: the tile's row max over the quad (the row's 4
// threads), as a logit (a plain tile holds raw products, whose max times the scale is the max logit; a padded
// tile's max goes through padded_logit, monotonic in the product), then m_new and alpha (online_softmax_rescale).
__device__ __forceinline__ void quad_max_and_rescale(float (&tile_max)[2], bool plain_tile, bool padded_tile,
                                                     float scale, float mask_filter_value, float (&row_max)[2],
                                                     float (&max_used)[2], float (&alpha)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
    tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
    if (plain_tile) tile_max[r] *= scale;  // max of x = scale * acc
    if (padded_tile) tile_max[r] = padded_logit(tile_max[r], scale, mask_filter_value);  // monotonic in acc
    // Step B: m_new and alpha = exp(m_old - m_new); a row with no finite logit yet subtracts 0 (no NaN).
    alpha[r] = online_softmax_rescale<true>(row_max[r], tile_max[r], max_used[r]);
  }
}

// Whether this thread's rows would get p = 0 from every key of a padded tile (its largest logit, tile_max, is
// already too far under the row max): the tile is skipped when the whole warp or block votes so.
__device__ __forceinline__ bool tile_adds_nothing(const float (&tile_max)[2], const float (&max_used)[2]) {
  bool zero = true;
#pragma unroll
  for (int r = 0; r < 2; ++r) zero = zero && fast_exp2((tile_max[r] - max_used[r]) * LOG2E) == 0.0f;
  return zero;
}
