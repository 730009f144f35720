"""``LoopState`` on its own: declared variables only, strict loads that name the variable, values given back."""

from __future__ import annotations

import copy
import math
import pickle
from collections import namedtuple

import pytest
import torch
from torch.distributed.checkpoint.stateful import Stateful

import mpckpt
from mpckpt.errors import ConfigError, StateError

Pair = namedtuple("Pair", "h c")


def make() -> mpckpt.LoopState:
    return mpckpt.LoopState(epoch=0, lr=20.0, best_val=math.inf, total_loss=0.0,
                            hidden=(torch.zeros(2, 3), torch.zeros(2, 3)))


def test_variables_are_attributes_and_only_declared_ones_can_be_set():
    loop = make()
    loop.lr /= 4
    loop.epoch += 1
    assert (loop.lr, loop.epoch, loop.best_val) == (5.0, 1, math.inf)
    with pytest.raises(AttributeError, match=r"no variable 'best_vall' \(did you mean 'best_val'\?\).*declare it"):
        loop.best_vall = 1.0  # a typo is an error, not a variable that is never saved
    with pytest.raises(AttributeError, match="no variable 'hiden'.*'hidden'"):
        loop.hiden  # noqa: B018
    assert not hasattr(loop, "nothing_like_it")
    with pytest.raises(AttributeError, match="cannot be deleted"):
        del loop.lr
    loop.declare(step_in_epoch=0)
    loop.step_in_epoch = 3
    assert loop.state_dict()["step_in_epoch"] == 3
    assert {"epoch", "lr", "step_in_epoch", "state_dict"} <= set(dir(loop))
    assert repr(mpckpt.LoopState(lr=0.5, hidden=(torch.zeros(2, 3),))) == "LoopState(lr=0.5, hidden=(tensor(float32, [2, 3]),))"
    assert isinstance(loop, Stateful)  # torch.distributed.checkpoint's protocol


@pytest.mark.parametrize(("make_it", "match"), [
    (lambda: mpckpt.LoopState(_private=1), "starts with '_'"),
    (lambda: mpckpt.LoopState(state_dict=1), "name of a LoopState method"),
    (lambda: mpckpt.LoopState(declare=1), "name of a LoopState method"),
    (lambda: mpckpt.LoopState(**{"not a name": 1}), "not a Python identifier"),
    (lambda: mpckpt.LoopState(**{"class": 1}), "not a Python identifier"),
    (lambda: mpckpt.LoopState(lr=1).declare(lr=2), "'lr' is declared already; set it with loop.lr = ..."),
])
def test_bad_declarations_are_config_errors_naming_the_variable(make_it, match):
    with pytest.raises(ConfigError, match=match):
        make_it()


def test_state_dict_detaches_tensors_keeps_containers_and_stores_generators_as_their_state():
    weight = torch.ones(3, requires_grad=True)
    generator = torch.Generator().manual_seed(5)
    loop = mpckpt.LoopState(hidden=(weight * 2, weight * 3), pair=Pair(weight * 4, [weight * 5]),
                            scores={"a": weight * 6}, gen=generator, name="run", count=3)
    state = loop.state_dict()
    assert type(state["hidden"]) is tuple and type(state["pair"]) is Pair and type(state["pair"].c) is list
    tensors = [*state["hidden"], state["pair"].h, state["pair"].c[0], state["scores"]["a"]]
    assert all(t.grad_fn is None and not t.requires_grad for t in tensors)
    assert [t[0].item() for t in tensors] == [2.0, 3.0, 4.0, 5.0, 6.0]
    assert state["hidden"][0].data_ptr() == loop.hidden[0].data_ptr()  # a view: save copies it, not state_dict
    assert torch.equal(state["gen"], generator.get_state()) and (state["name"], state["count"]) == ("run", 3)


def test_a_load_gives_every_variable_the_checkpoints_value():
    loop = make()
    generator = torch.Generator().manual_seed(1)
    loop.declare(gen=generator, pair=Pair(torch.zeros(1), torch.zeros(1)))
    saved = copy.deepcopy(loop)
    saved.lr, saved.best_val, saved.epoch = 5.0, 3.25, 2
    saved.hidden = (torch.full((2, 3), 1.5), torch.full((2, 3), -1.5))
    saved.pair = Pair(torch.ones(1), torch.ones(1))
    saved.gen.manual_seed(7)
    state = saved.state_dict()
    expected_draw = torch.rand(4, generator=torch.Generator().manual_seed(7))
    loop.load_state_dict(state)
    assert (loop.lr, loop.best_val, loop.epoch) == (5.0, 3.25, 2)
    assert type(loop.hidden) is tuple and torch.equal(loop.hidden[1], torch.full((2, 3), -1.5))
    assert type(loop.pair) is Pair and torch.equal(loop.pair.c, torch.ones(1))
    assert loop.gen is generator and torch.equal(torch.rand(4, generator=generator), expected_draw)  # in place


def test_a_tensor_comes_back_on_the_device_of_the_one_it_replaces():
    loop = mpckpt.LoopState(hidden=(torch.zeros(2, device="meta"), torch.zeros(2)), late=None)
    loop.load_state_dict({"hidden": (torch.ones(2), torch.ones(2)), "late": torch.ones(2)})
    assert [h.device.type for h in loop.hidden] == ["meta", "cpu"] and loop.late.device.type == "cpu"


def test_a_checkpoint_without_a_variable_or_with_one_more_is_a_state_error_naming_it():
    loop = make()
    state = loop.state_dict()
    loop.lr = 1.0
    without_hidden = {k: v for k, v in state.items() if k != "hidden"}
    with pytest.raises(StateError, match=r"lacks variable 'hidden' that this LoopState declares.*strict=False") as e:
        loop.load_state_dict(without_hidden)
    assert e.value.key == "hidden"
    with pytest.raises(StateError, match=r"holds variable 'seq_len' that this LoopState does not declare") as e:
        loop.load_state_dict({**state, "seq_len": 35})
    assert e.value.key == "seq_len"
    with pytest.raises(StateError, match=r"lacks variables 'lr', 'hidden'.*holds variable 'x'"):
        loop.load_state_dict({**{k: v for k, v in state.items() if k not in ("lr", "hidden")}, "x": 1})
    assert loop.lr == 1.0  # an error changes nothing
    with pytest.raises(StateError, match="holds a list here, not a LoopState's variables"):
        loop.load_state_dict([1, 2])  # type: ignore[arg-type]
    loop.load_state_dict({**without_hidden, "seq_len": 35}, strict=False)  # what matches; the rest stays
    assert loop.lr == 20.0 and torch.equal(loop.hidden[0], torch.zeros(2, 3))


def test_a_generator_state_that_does_not_fit_is_a_state_error_naming_the_variable():
    generator = torch.Generator().manual_seed(3)
    loop = mpckpt.LoopState(gen=generator, other=torch.Generator(), lr=1.0)
    before = generator.get_state()
    with pytest.raises(StateError, match="variable 'other'"):  # after 'gen' was checked: it stays as it was
        loop.load_state_dict({"gen": torch.Generator().manual_seed(4).get_state(), "other": 0.5, "lr": 2.0})
    assert torch.equal(generator.get_state(), before) and loop.lr == 1.0
    with pytest.raises(StateError, match="variable 'gen' is a torch.Generator and the checkpoint holds a float"):
        loop.load_state_dict({"gen": 0.5}, strict=False)
    with pytest.raises(StateError, match="variable 'gen': the checkpoint's generator state does not fit"):
        loop.load_state_dict({"gen": torch.zeros(3, dtype=torch.uint8)}, strict=False)


def test_copies_and_pickles_are_independent_holders_of_the_same_variables():
    loop = make()
    for other in (copy.copy(loop), copy.deepcopy(loop), pickle.loads(pickle.dumps(loop))):
        other.lr = 1.0
        assert loop.lr == 20.0 and sorted(other.state_dict()) == sorted(loop.state_dict())
        with pytest.raises(AttributeError):
            other.undeclared = 1
