"""How a context stores gradients (``_storage``): the rules of ``.grad``, checked without RPC."""

from __future__ import annotations

import pickle

import torch

from distgrad.rpc._storage import GradientStore
from distgrad.rpc._wire import GradientMessage, Reply
from tests import _support as support


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_a_gradient_of_its_own_is_kept_without_a_copy() -> None:
    x, g = support.leaf(1, 3, 4), torch.ones(3, 4, dtype=torch.float64)
    store = GradientStore()
    store.add_all([(x, g)])
    assert store.get(x) is g


def test_an_expanded_gradient_is_copied_and_laid_out_like_its_tensor() -> None:
    x = support.leaf(1, 4, 3).t()  # strides (1, 3): the gradient takes them, as .grad does
    store = GradientStore()
    store.add_all([(x, torch.ones(1, dtype=torch.float64).expand(3, 4))])
    got = store.get(x)
    assert got is not None and got.stride() == x.stride()
    torch.testing.assert_close(got, torch.ones(3, 4, dtype=torch.float64))


def test_one_buffer_for_two_leaves_is_copied_for_both() -> None:
    a, b = support.leaf(1, 3), support.leaf(2, 3)
    g = torch.ones(3, dtype=torch.float64)
    store = GradientStore()
    store.add_all([(a, g), (b, g)])
    ga, gb = store.get(a), store.get(b)
    assert ga is not None and gb is not None
    assert len({_ptr(ga), _ptr(gb), _ptr(g)}) == 3


def test_memory_shared_with_a_stored_gradient_or_the_user_is_copied() -> None:
    a, b, c = support.leaf(1, 3), support.leaf(2, 3), support.leaf(3, 3)
    g, user = torch.ones(3, dtype=torch.float64), torch.full((3,), 2.0, dtype=torch.float64)
    store = GradientStore()
    store.add_all([(a, g)])
    store.add_all([(b, g)])  # a later phase hands the same buffer again
    store.add_all([(c, user)], foreign=frozenset({_ptr(user)}))
    assert store.get(a) is g
    assert _ptr(store.get(b)) != _ptr(g)  # type: ignore[arg-type]
    assert _ptr(store.get(c)) != _ptr(user)  # type: ignore[arg-type]


def test_a_second_gradient_is_added_out_of_place() -> None:
    x = support.leaf(1, 3)
    first, second = torch.ones(3, dtype=torch.float64), torch.full((3,), 2.0, dtype=torch.float64)
    store = GradientStore()
    store.add_all([(x, first)])
    handed_out = store.get(x)
    store.add_all([(x, second)])
    torch.testing.assert_close(handed_out, torch.ones(3, dtype=torch.float64))
    torch.testing.assert_close(store.get(x), torch.full((3,), 3.0, dtype=torch.float64))


def _sparse(indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return torch.sparse_coo_tensor(indices, values, (10, 3), check_invariants=True)


def test_sparse_gradients_keep_their_layout_and_only_contiguous_ones_are_kept() -> None:
    x = support.leaf(1, 10, 3)
    kept = _sparse(torch.tensor([[1, 2]]), torch.ones(2, 3, dtype=torch.float64))
    values = torch.ones(1, 3, dtype=torch.float64).expand(4, 3)
    expanded = _sparse(torch.ones(1, 1, dtype=torch.long).expand(1, 4), values)
    store = GradientStore()
    store.add_all([(x, kept)])
    assert store.get(x) is kept
    y = support.leaf(2, 10, 3)
    store.add_all([(y, expanded)])
    got = store.get(y)
    assert got is not None and got.is_sparse and got._values().is_contiguous()
    torch.testing.assert_close(got.to_dense(), expanded.to_dense())
    store.add_all([(y, torch.ones(10, 3, dtype=torch.float64))])  # sparse + dense: dense
    assert not store.get(y).is_sparse  # type: ignore[union-attr]


def test_messages_pickle_as_their_fields() -> None:
    message = GradientMessage(1, 2, [torch.ones(2), None], 3, 0.5, "worker1", {"w": frozenset({4})})
    back = pickle.loads(pickle.dumps(message))
    assert (back.context_id, back.message_id, back.pass_id, back.sender) == (1, 2, 3, "worker1")
    assert back.lineage == {"w": frozenset({4})} and back.retain_graph is True
    assert pickle.loads(pickle.dumps(Reply(7, [None]))) == Reply(7, [None])
