"""Reference backend: NumPy, stock ORT 1.31.1 CPU math step by step (docs/SEMANTICS.md §3).

    1. Q gets b_q and goes to BNSH; BSNH key/value get b_k/b_v and go to BNSH; BNSH key/value are used as they are
       (their bias is ignored); a past is prepended along the sequence axis (present = concat(past, new)).
    2. scores_BNST = scale * Q·Kᵀ in float32 (ORT: the GEMM's alpha).
    3. scores += attention_bias, broadcast over B and N when those dims are 1.
    4. scores += mask_BST: a padded key gets mask_filter_value (added, not substituted: a fully padded row becomes
       softmax of the raw scores); causal rows i < S-1 hold FLOAT32_LOWEST at keys j > P + i in the mask (in place
       of the padding value there), which is then added like the rest; the last query row is never causally
       masked, which matters only when L != S.
    qk (output 3, when asked for) is a copy of the scores at this point: scale * Q·Kᵀ + attention_bias + mask, the
       masked entries holding their filter values (docs/SEMANTICS.md §3.8).
    5. probs = softmax over T, max-subtracted, in float32.
    6. out = probs·V, written as (B, S, N·Hv).
A shared buffer (docs/SEMANTICS.md §3.9): the past is rows [0, P) of the (B, N, M, H) past_key / past_value, on the
beam path (§3.10) row j of batch row b*W + w read from row b*W + cache_indirection[b, w, j]; the presents are the
past with the new rows written at [P, P+L).
float16/bfloat16 calls arrive as float32 values of that dtype and are computed in float32, as ORT's CPU kernel
does for float16 (the Cast back to the node's dtype happens in the graph).
"""

from __future__ import annotations

import numpy as np

from mha_ep.engine.problem import FLOAT32_LOWEST, MhaProblem, MhaResult


class ReferenceBackend:
    name = "reference"
    device = "cpu (NumPy)"

    def run(self, problem: MhaProblem, borrow_outputs: bool = False) -> MhaResult:
        return run_reference(problem)  # (fresh arrays either way)


def to_BNSH(x_BSD: np.ndarray, num_heads: int) -> np.ndarray:
    b, s, d = x_BSD.shape
    return x_BSD.reshape(b, s, num_heads, d // num_heads).transpose(0, 2, 1, 3)


def additive_mask_BST(problem: MhaProblem, dtype=np.float32) -> np.ndarray | None:
    """Step 4's float32 mask (B or 1, S, T), or None when the call has neither padding nor causal masking."""
    g = problem.geometry
    s, t = g.q_seq, g.total_seq
    mask_BST = None
    if problem.padding_mask is not None:
        keep_BST = problem.padding_mask.keep_BST(s, t)
        mask_BST = np.where(keep_BST, dtype(0.0), dtype(problem.mask_filter_value)).astype(dtype)
    if problem.causal:
        rows = np.arange(s)[:, None]
        cols = np.arange(t)[None, :]
        future_ST = (cols > g.past_seq + rows) & (rows < s - 1)
        if mask_BST is None:
            mask_BST = np.zeros((1, s, t), dtype)
        mask_BST = np.where(future_ST[None], dtype(FLOAT32_LOWEST), mask_BST).astype(dtype)
    return mask_BST


def softmax_lastaxis(scores: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        shifted = scores - scores.max(axis=-1, keepdims=True)
        e = np.exp(shifted)
        return e / e.sum(axis=-1, keepdims=True)


def run_reference(problem: MhaProblem, compute_dtype=np.float32) -> MhaResult:
    """Steps 1-6 in ``compute_dtype`` (float32 reproduces ORT; float64 is the oracle where ORT cannot run).

    Outputs are returned in ``compute_dtype``; the backend interface (``ReferenceBackend.run``) uses float32.
    """
    g = problem.geometry
    f32 = compute_dtype  # the name is kept short; it is float64 when the caller asks for the oracle
    n = g.num_heads
    query = problem.query_BSD.astype(f32, copy=False)
    if problem.bias_q is not None:
        query = query + problem.bias_q.astype(f32)
    q_BNSH = to_BNSH(query, n)

    if problem.kv_layout == "BSNH":
        key, value = problem.key.astype(f32, copy=False), problem.value.astype(f32, copy=False)
        if problem.bias_k is not None:
            key = key + problem.bias_k.astype(f32)
            value = value + problem.bias_v.astype(f32)
        k_BNLH, v_BNLH = to_BNSH(key, n), to_BNSH(value, n)
    else:
        k_BNLH, v_BNLH = problem.key.astype(f32, copy=False), problem.value.astype(f32, copy=False)

    if problem.past_key_BNPH is not None:
        past_k_BNPH, past_v_BNPH = past_rows(problem, problem.past_key_BNPH), past_rows(problem, problem.past_value_BNPH)
        k_BNTH = np.concatenate([past_k_BNPH.astype(f32, copy=False), k_BNLH], axis=2)
        v_BNTH = np.concatenate([past_v_BNPH.astype(f32, copy=False), v_BNLH], axis=2)
    else:
        k_BNTH, v_BNTH = k_BNLH, v_BNLH

    scores_BNST = np.matmul(q_BNSH, k_BNTH.transpose(0, 1, 3, 2)) * f32(problem.scale)
    with np.errstate(over="ignore"):  # lowest + a huge negative bias is -inf in ORT's float32 too
        if problem.attention_bias is not None:
            scores_BNST = scores_BNST + problem.attention_bias.astype(f32, copy=False)
        mask_BST = additive_mask_BST(problem, f32)
        if mask_BST is not None:
            scores_BNST = scores_BNST + mask_BST[:, None]
    qk_BNST = np.array(scores_BNST, dtype=f32) if problem.want_qk else None  # output 3: before the softmax
    probs_BNST = softmax_lastaxis(scores_BNST.astype(f32, copy=False))
    out_BNSH = np.matmul(probs_BNST, v_BNTH)
    out_BSDv = np.ascontiguousarray(out_BNSH.transpose(0, 2, 1, 3)).reshape(g.batch, g.q_seq, g.v_hidden)
    if problem.shared is not None:
        present_k = shared_present(problem, problem.past_key_BNPH, k_BNLH, f32) if problem.want_present_key else None
        present_v = shared_present(problem, problem.past_value_BNPH, v_BNLH, f32) if problem.want_present_value else None
    else:
        present_k = np.ascontiguousarray(k_BNTH, dtype=f32) if problem.want_present_key else None
        present_v = np.ascontiguousarray(v_BNTH, dtype=f32) if problem.want_present_value else None
    return MhaResult(output_BSDv=out_BSDv.astype(f32, copy=False), present_key_BNTH=present_k,
                     present_value_BNTHv=present_v, qk_BNST=qk_BNST)  # fmt: skip


def past_rows(problem: MhaProblem, past_BNPH: np.ndarray) -> np.ndarray:
    """The rows of the past that attention reads: all of them, or rows [0, P) of a shared buffer, redirected per
    batch row by cache_indirection on the beam path."""
    shared = problem.shared
    if shared is None:
        return past_BNPH
    p = shared.past_seq
    if not shared.beams_active:
        return past_BNPH[:, :, :p]
    b, n = past_BNPH.shape[:2]
    w = shared.beams
    source_BP = (np.arange(b) // w * w)[:, None] + problem.cache_indirection_BWM.reshape(b, -1)[:, :p]
    return past_BNPH[source_BP[:, None, :], np.arange(n)[None, :, None], np.arange(p)[None, None, :]]


def shared_present(problem: MhaProblem, past_BNMH: np.ndarray, new_BNLH: np.ndarray, dtype) -> np.ndarray:
    """A shared buffer's present: the past, with the L new rows at [P, P+L)."""
    p = problem.shared.past_seq
    present_BNMH = np.array(past_BNMH, dtype=dtype)
    present_BNMH[:, :, p : p + new_BNLH.shape[2]] = new_BNLH
    return present_BNMH
