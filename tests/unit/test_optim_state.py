"""``_codec.optim_state``: an optimizer's state dict made from the last save's numbering is the one
``Optimizer.state_dict()`` makes, whatever the training loop changed in between; an optimizer whose
state dict is not torch's own (an override, a hook) is always asked itself."""

from __future__ import annotations

from typing import Any

import torch

from mpckpt._codec import optim_state
from mpckpt._codec.optim_state import OptimizerStates


def _same_as_torch(ours: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
    theirs = optimizer.state_dict()
    assert list(ours) == list(theirs) == ["state", "param_groups"]
    assert list(ours["state"]) == list(theirs["state"])
    for key in theirs["state"]:
        assert ours["state"][key] is theirs["state"][key]  # the very same per-parameter dicts
    assert len(ours["param_groups"]) == len(theirs["param_groups"])
    for a, b in zip(ours["param_groups"], theirs["param_groups"], strict=True):
        assert list(a) == list(b)
        assert a == b


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    optimizer.zero_grad()
    model(torch.randn(3, 8, generator=torch.Generator().manual_seed(seed))).pow(2).mean().backward()
    optimizer.step()


def test_the_numbered_state_dict_follows_every_change_the_loop_makes() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    states = OptimizerStates()
    _same_as_torch(states.state_dict(optimizer), optimizer)  # no state yet
    _step(model, optimizer, 1)
    _same_as_torch(states.state_dict(optimizer), optimizer)  # state for every parameter
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    _step(model, optimizer, 3)
    scheduler.step()
    packed = states.state_dict(optimizer)
    _same_as_torch(packed, optimizer)
    assert packed["param_groups"][0]["lr"] == 5e-4  # read at each save
    extra = torch.nn.Linear(8, 8)
    optimizer.add_param_group({"params": list(extra.parameters()), "lr": 1e-2})
    _same_as_torch(states.state_dict(optimizer), optimizer)  # a group more: numbered again
    model.add_module("2", extra)
    _step(model, optimizer, 2)
    _same_as_torch(states.state_dict(optimizer), optimizer)  # the new group's state appears
    replaced = torch.nn.Parameter(torch.zeros(8))
    old = optimizer.param_groups[0]["params"][1]
    optimizer.param_groups[0]["params"][1] = replaced  # a parameter swapped in place, its state dropped
    optimizer.state.pop(old)
    _same_as_torch(states.state_dict(optimizer), optimizer)
    first = next(iter(optimizer.state))
    optimizer.state[first] = optimizer.state.pop(first)  # the state's order changes
    _same_as_torch(states.state_dict(optimizer), optimizer)


def test_a_repeated_save_reuses_the_numbering(monkeypatch) -> None:
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _step(model, optimizer, 0)
    states = OptimizerStates()
    numbered = []
    real = OptimizerStates._number
    monkeypatch.setattr(OptimizerStates, "_number", lambda self, o, ids: numbered.append(1) or real(self, o, ids))
    asked = []
    monkeypatch.setattr(torch.optim.SGD, "state_dict", lambda self: asked.append(1) or torch.optim.Optimizer.state_dict(self),
                        raising=False)
    monkeypatch.setattr(optim_state, "_TORCH_STATE_DICT", torch.optim.SGD.state_dict)  # (the spy is "torch's own")
    for seed in range(4):
        _step(model, optimizer, seed)
        _same_as_torch(states.state_dict(optimizer), optimizer)
    assert numbered == [1]  # numbered once
    assert len(asked) == 1 + 4  # torch's own asked once to check the numbering, then only by the comparisons


def test_an_optimizer_whose_state_dict_is_not_torchs_own_is_asked_itself() -> None:
    model = torch.nn.Linear(4, 4)

    class Custom(torch.optim.SGD):
        def state_dict(self) -> dict[str, Any]:
            sd = super().state_dict()
            sd["extra"] = 7
            return sd

    custom = Custom(model.parameters(), lr=0.1)
    states = OptimizerStates()
    assert states.state_dict(custom)["extra"] == 7
    hooked = torch.optim.SGD(model.parameters(), lr=0.1)
    calls: list[int] = []
    hooked.register_state_dict_post_hook(lambda opt, sd: calls.append(1) or {**sd, "hooked": True})
    for _ in range(2):
        assert states.state_dict(hooked)["hooked"] is True
    assert calls == [1, 1]


def test_a_numbering_torch_disagrees_with_sends_that_optimizer_to_state_dict_for_good(monkeypatch) -> None:
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monkeypatch.setattr(optim_state, "_same", lambda ours, theirs: False)  # (as another torch's numbering would)
    states = OptimizerStates()
    _same_as_torch(states.state_dict(optimizer), optimizer)
    monkeypatch.undo()
    asked: list[int] = []
    real = optimizer.state_dict
    optimizer.state_dict = lambda: asked.append(1) or real()  # type: ignore[method-assign]
    states.state_dict(optimizer)
    assert asked == [1]
