"""Chunked (chunk BT = 64) gated delta rule for prefill: the form both prefill kernels compute.

Reference: ``gdn_chunked_ref`` in ref.py; README.md derives the form. Per value head j and chunk of c <= BT
tokens, with G the in-chunk cumulative log-decay and h the state at the chunk start:
  A = strict_tril(b_i k_i.k_j e^(G_i-G_j)),  (I + A) W = b e^G K,  (I + A) U = b V        (intra)
  P = tril(q_i.k_j e^(G_i-G_j))                                                              (intra)
  V' = U - W h,  O = [e^G (Q h) + P V'] / sqrt(S),  h <- e^(G_last) h + (K e^(G_last-G))^T V'  (state pass)

The intra-chunk solve (chunk_intra_mma.py) needs no state, so it runs with one block per (chunk, value
head): T/64 x Hv blocks. The state pass (chunk_state_f16.py) is serial over chunks; value columns of h are
independent, so it runs one block per (value tile, value head) and keeps its S x BV slice of h in shared
memory for the whole sequence.

Scratch layouts (prefill workspace): v is read from u [T, C], q and k (L2-normalised, float16) from
qk16 [T, 2·Hk·S], beta, g: [T, Hv]; written by intra: G [Hv, T],
U: [Hv, T, S] float32, W: [Hv, T, S] and P: [Hv, T, BT] float16 (P row t holds the chunk-local row; columns
up to the end of its 16-row block are written, zero above the diagonal).
"""

BT = 64            # chunk length
