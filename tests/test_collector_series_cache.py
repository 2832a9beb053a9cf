"""The per-stream series-dictionary cache (collector/ingest/validate.py SeriesCache): a batch that repeats the
last dictionary reuses its derived columns, and anything else is derived and checked afresh."""

from __future__ import annotations

import pytest

from collector_helpers import sample_batch
from gpuagent.collector.ingest.validate import BatchError, SeriesCache, prepare_batch


def _rows(prepared):
    return sorted(zip(*(prepared.samples.column(c).to_pylist() for c in ("metric", "gpu", "labels", "value"))))


def test_a_repeated_dictionary_is_reused_and_gives_the_same_table():
    cache = SeriesCache()
    for seq in (1, 2, 3):
        b = sample_batch("n1", seq)
        assert prepare_batch(b, series_cache=cache).samples.equals(prepare_batch(b).samples)
    assert (cache.misses, cache.hits) == (1, 2)


@pytest.mark.parametrize("change", ["label", "metric", "gpu_index", "id", "extra"])
def test_a_changed_dictionary_is_derived_again_never_served_stale(change):
    cache = SeriesCache()
    prepare_batch(sample_batch("n1", 1), series_cache=cache)
    b = sample_batch("n1", 2)
    s = b.samples.series
    if change == "label":
        s[0].labels["reason"] = "hw_slowdown"
    elif change == "metric":
        s[1].metric = "cpu_user_percent"
    elif change == "gpu_index":
        s[2].gpu = 5
    elif change == "id":      # ids 3 and 7 swap meanings: the same set of ids, other series behind them
        s[1].id, s[2].id = 7, 3
    else:
        s.add(id=99, metric="load1", gpu=-1)
    got = prepare_batch(b, series_cache=cache)
    assert _rows(got) == _rows(prepare_batch(b)) and cache.misses == 2
    if change == "label":
        assert "a=1,reason=hw_slowdown" in got.samples.column("labels").to_pylist()


def test_an_invalid_dictionary_is_refused_after_a_valid_one_and_the_valid_one_stays():
    cache = SeriesCache()
    prepare_batch(sample_batch("n1", 1), series_cache=cache)
    bad = sample_batch("n1", 2)
    bad.samples.series[1].id = 10        # the same id twice
    with pytest.raises(BatchError, match="same series id twice"):
        prepare_batch(bad, series_cache=cache)
    unknown = sample_batch("n1", 3)
    unknown.samples.series_id[0] = 999   # the cached dictionary, a sample outside it
    with pytest.raises(BatchError, match="series id 999"):
        prepare_batch(unknown, series_cache=cache)
    prepare_batch(sample_batch("n1", 4), series_cache=cache)
    assert cache.hits == 2    # the unknown-id batch and the last one both matched the valid dictionary
