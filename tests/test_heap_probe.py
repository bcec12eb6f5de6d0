

def test_onednn_cache_capacity_is_the_smaller_of_onednn_and_ideep(monkeypatch: pytest.MonkeyPatch) -> None:
    from load_tests.heap_probe import onednn_cache_capacity

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    assert onednn_cache_capacity() == 1024  # both defaults
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "64")
    assert onednn_cache_capacity() == 64  # ideep's cache alone still holds 64 shapes' worth
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "16")
    assert onednn_cache_capacity() == 16
