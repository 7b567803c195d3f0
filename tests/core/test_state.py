"""ClientStateStore: pending writes per round, commit, crash recovery."""
import pytest
import torch

from fedguide.core.state import ClientStateStore


@pytest.fixture
def store(tmp_path):
    return ClientStateStore(tmp_path / "client_state")


def test_unknown_client_has_empty_state(store):
    assert store.get(0) == {}
    assert store.get(123, 5) == {}


def test_put_invisible_until_commit(store):
    store.put(3, 1, {"count": 1})
    assert store.get(3) == {}, "an uncommitted write must not be visible outside its round"
    assert store.get(3, 1) == {"count": 1}, "within round r, the client's own pending write wins"
    assert store.get(3, 2) == {}, "a pending write of round 1 is not visible from round 2 before commit"
    store.commit(1)
    assert store.get(3) == {"count": 1}
    assert store.get(3, 2) == {"count": 1}


def test_pending_write_shadows_committed(store):
    store.put(0, 1, {"v": 1})
    store.commit(1)
    store.put(0, 2, {"v": 2})
    assert store.get(0) == {"v": 1}
    assert store.get(0, 2) == {"v": 2}
    store.commit(2)
    assert store.get(0) == {"v": 2}


def test_commit_replaces_whole_state(store):
    store.put(0, 1, {"a": 1, "t": torch.ones(2)})
    store.commit(1)
    store.put(0, 2, {"b": 2})
    store.commit(2)
    assert store.get(0) == {"b": 2}


def test_commit_only_touches_its_clients(store):
    store.put(0, 1, {"v": "zero"})
    store.put(1, 1, {"v": "one"})
    store.commit(1)
    store.put(1, 2, {"v": "one-b"})
    store.commit(2)
    assert store.get(0) == {"v": "zero"}
    assert store.get(1) == {"v": "one-b"}


def test_commit_of_round_without_writes_is_noop(store):
    store.commit(9)
    assert store.get(0) == {}


def test_tensors_and_scalars_round_trip(store):
    state = {
        "weights": torch.randn(4, 3),
        "counts": torch.arange(5, dtype=torch.int64),
        "flag": torch.tensor(True),
        "half": torch.tensor([1.5, -2.0], dtype=torch.float16),
        "steps": 17,
        "lr": 0.125,
        "name": "client",
        "nothing": None,
        "seen": [1, 2, 3],
    }
    store.put(2, 1, state)
    store.commit(1)
    got = store.get(2)
    assert set(got) == set(state)
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert isinstance(got[k], torch.Tensor), k
            assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
            assert torch.equal(got[k], v), k
        else:
            assert got[k] == v and type(got[k]) is type(v), k


def test_put_accepts_grad_and_noncontiguous_tensors(store):
    w = torch.randn(3, 4, requires_grad=True)
    store.put(0, 1, {"w": w * 2, "t": torch.randn(4, 3).t()})
    got = store.get(0, 1)
    assert torch.allclose(got["w"], (w * 2).detach())
    assert got["t"].shape == (3, 4)


def test_state_is_a_copy(store):
    t = torch.zeros(3)
    store.put(0, 1, {"t": t})
    t.add_(1)  # later in-place changes do not leak into the stored state
    assert torch.equal(store.get(0, 1)["t"], torch.zeros(3))


def test_store_reopened_from_disk(tmp_path):
    ClientStateStore(tmp_path / "s").put(0, 1, {"v": 1})
    a = ClientStateStore(tmp_path / "s")
    a.commit(1)
    assert ClientStateStore(tmp_path / "s").get(0) == {"v": 1}


def test_recover_commits_covered_rounds_and_drops_the_rest(tmp_path):
    root = tmp_path / "s"
    store = ClientStateStore(root)
    store.put(0, 1, {"v": 1})
    store.put(1, 2, {"v": 2})
    store.put(0, 3, {"v": 3})  # round 3 was never checkpointed
    store.put(2, 10, {"v": 10})  # numeric, not lexical, order: 10 > 2

    # A fresh store after the "crash", checkpoint at round 2.
    recovered = ClientStateStore(root)
    recovered.recover(2)
    assert recovered.get(0) == {"v": 1}
    assert recovered.get(1) == {"v": 2}
    assert recovered.get(2) == {}
    assert recovered.get(0, 3) == {"v": 1}, "the dropped round-3 write is gone"
    assert sorted(p.name for p in root.iterdir()) == ["committed"]


def test_recover_applies_rounds_in_order(tmp_path):
    store = ClientStateStore(tmp_path / "s")
    store.put(0, 2, {"v": 2})
    store.put(0, 10, {"v": 10})
    store.put(0, 9, {"v": 9})
    store.recover(10)
    assert store.get(0) == {"v": 10}, "later rounds must be committed after earlier ones (numeric order)"


def test_recover_zero_drops_everything(store):
    store.put(0, 1, {"v": 1})
    store.recover(0)
    assert store.get(0) == {} and store.get(0, 1) == {}


def test_disk_bytes_grows(store):
    before = store.disk_bytes()
    store.put(0, 1, {"w": torch.zeros(1000)})
    assert store.disk_bytes() >= before + 4000


def test_tensors_sharing_memory(store):
    # State is documented as "tensors and JSON-able scalars"; two entries that view one buffer
    # (e.g. full weights plus a slice of them) are a valid state.
    w = torch.arange(10.0)
    state = {"weights": w, "head": w[6:]}
    try:
        store.put(0, 1, state)
    except RuntimeError as err:
        pytest.fail(
            "BUG (fl/state.py ClientStateStore.put): safetensors.save_file rejects tensors that share "
            f"memory, so a state holding a tensor and a view of it cannot be saved: {str(err).strip()[:80]}"
        )
    got = store.get(0, 1)
    assert torch.equal(got["weights"], w) and torch.equal(got["head"], w[6:])
