"""Fingerprints of pieces' bytes, which incremental saves compare (saving/_fingerprint.py)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from tpu_ckpt.saving import _fingerprint
from tpu_ckpt.saving._fingerprint import _lanes, fingerprints


def test_the_device_fingerprint_sees_every_changed_word_and_equal_bytes_as_equal():
    """The scheme that runs on accelerators, run here on the CPU: 4 lanes of 32 bits."""
    rng = np.random.default_rng(0)
    for dtype in (np.float32, ml_dtypes.bfloat16, np.int8, np.uint16, np.bool_):
        base = rng.integers(0, 2, 1000).astype(dtype) if dtype is np.bool_ else rng.normal(size=1000).astype(dtype)
        variants = [base.copy() for _ in range(4)]
        variants[1][999] = 1 - variants[1][999] if dtype is np.bool_ else variants[1][999] + 1
        other = next(k for k in range(4, 1000) if base[k] != base[3])
        variants[2][[3, other]] = base[[other, 3]]  # two words swapped
        variants[3] = variants[3].reshape(10, 100)  # the same bytes, another shape: the shape is compared beside
        lanes = np.asarray(_lanes(tuple(jnp.asarray(v) for v in (base, *variants))))
        assert lanes.shape == (5, 4) and lanes.dtype == np.uint32
        np.testing.assert_array_equal(lanes[0], lanes[1])
        np.testing.assert_array_equal(lanes[0], lanes[4])
        assert (lanes[2] != lanes[0]).all() and (lanes[3] != lanes[0]).all(), dtype


def test_host_fingerprints_are_128_bits_and_a_changed_sample_skips_the_hash():
    a = np.arange(1 << 18, dtype=np.float32)  # 1 MiB: the smallest piece that is sampled first
    (sample, first), (_, same), (_, other) = fingerprints([a, jnp.asarray(a), a + 1], [None] * 3, [False] * 3)
    assert len(first) == 17 and first == same != other and len(sample) == 64 * 4
    changed = a.copy()
    changed[-1] += 1  # the last element: the sample always holds the first and the last
    [(_, unknown), (_, hashed), (_, small)] = fingerprints(
        [changed, a.copy(), changed[1:]], [(sample, first)] * 3, [False] * 3
    )
    assert unknown == b"" and hashed == first and len(small) == 17
    # Known unchanged (the same jax.Array as last time): the last fingerprint, not hashed again.
    assert fingerprints([changed], [(sample, first)], [True]) == [(sample, first)]


def test_pieces_on_a_device_are_fingerprinted_there_in_groups(monkeypatch):
    """On an accelerator the device scheme runs; here it is chosen for the CPU's arrays,
    with groups of 3 pieces, to run the real programs and check the grouping."""
    monkeypatch.setattr(_fingerprint, "_on_device", lambda data: isinstance(data, jax.Array))
    monkeypatch.setattr(_fingerprint, "_GROUP", 3)
    pieces = [jnp.arange(10 + i, dtype=jnp.float32) for i in range(7)] + [np.arange(5), jnp.ones(3, jnp.bfloat16)]
    first = fingerprints(pieces, [None] * len(pieces), [False] * len(pieces))
    assert [digest[:1] for _, digest in first] == [b"x"] * 7 + [b"b", b"x"]
    assert all(len(digest) == 17 for _, digest in first) and len({digest for _, digest in first}) == len(pieces)
    copies = [jnp.array(np.asarray(p)) if isinstance(p, jax.Array) else p.copy() for p in pieces]
    assert fingerprints(copies, first, [False] * len(pieces)) == first
    compiled = _lanes._cache_size()
    unchanged = [i % 2 == 0 for i in range(len(pieces))]  # device pieces are hashed all the same: no new program
    assert fingerprints(pieces, first, unchanged) == first and _lanes._cache_size() == compiled
    lanes = np.asarray(_lanes((pieces[0],)))[0]
    assert first[0][1] == b"x" + lanes.astype("<u4").tobytes()


def test_a_piece_of_several_chunks_is_hashed_by_chunks(monkeypatch):
    monkeypatch.setattr(_fingerprint, "_CHUNK", 1024)
    a = np.arange(1000, dtype=np.float32)  # 4 chunks, the last one short
    changed = a.copy()
    changed[300] = -1  # in the second chunk
    [(_, whole), (_, same), (_, other)] = fingerprints([a, a.copy(), changed], [None] * 3, [False] * 3)
    assert len(whole) == 17 and whole == same != other
    monkeypatch.setattr(_fingerprint, "_CHUNK", 16 << 20)
    # one chunk: the digest of the bytes themselves
    assert fingerprints([a], [None], [False])[0][1] not in (whole, other)
