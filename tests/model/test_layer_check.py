"""compare_layers (benchmarks/e2e/layer_check.py) on streams produced by the reference itself, token by token.

The GPU side needs a GPU (tests/model/test_gpu_model.py); here the streams come from the float reference run
as the GPU runs it (a prompt chunk, then one token per step), which checks the indexing and the claim that one
causal call over the whole sequence reproduces the incremental run.
"""
import numpy as np

from benchmarks.e2e.layer_check import compare_layers
from ninfer_numba.model.reference import ReferenceModel
from ninfer_numba.model.weights import open_model


def _incremental_streams(weights, ids, chunks):
    ref = ReferenceModel(weights)
    st = ref.new_state(len(ids))
    streams = [[] for _ in range(weights.config.n_layer + 1)]
    rows = []
    for part in chunks:
        x = weights.embed(np.asarray(ids[part], np.int64))
        streams[0].append(x)
        for i in range(weights.config.n_layer):
            x = ref.layer(i, x, st)
            streams[i + 1].append(x)
        st.pos += len(x)
        rows.append(ref.head(x[-1:]))
    return [np.concatenate(s) for s in streams], np.concatenate(rows)


def test_reference_streams_compare_clean(tiny_untied):
    w = open_model(tiny_untied)
    ids = np.random.default_rng(0).integers(0, w.config.n_vocab, 21)
    chunks = [slice(0, 16)] + [slice(i, i + 1) for i in range(16, 21)]
    streams, logits = _incremental_streams(w, ids, chunks)
    r = compare_layers(w, streams, logits, emulate_int8=False)
    assert len(r["layers"]) == w.config.n_layer and logits.shape == (6, w.config.n_vocab)
    assert r["max_rel"] < 1e-5 and r["head_rel"] < 1e-5 and r["head_top1"] == 1.0, r
    # a wrong layer output is seen, in that layer only
    streams[3] = streams[3] * 1.01
    bad = compare_layers(w, streams, logits, emulate_int8=False)["layers"]
    assert bad[2]["rel"] > 5e-3 and bad[3]["rel"] > 5e-3 and bad[0]["rel"] < 1e-5 and bad[1]["rel"] < 1e-5
