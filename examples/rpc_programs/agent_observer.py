"""Reinforcement learning with an agent and observers: worker0's agent holds the policy;
observers on worker1 and worker2 (created with ``rpc.remote``) each play episodes of a toy
environment, asking the agent for every action through its RRef and reporting every reward;
after each episode the agent learns with REINFORCE (local autograd). No distributed autograd:
this program tests ``remote``, RRefs passed over RPC and concurrent ``rpc_async`` calls.

Each observer's actions are drawn from its own seeded generator on the agent, so the
episodes are the same whichever observer's call arrives first. The agent keeps the states
and actions, and computes the log-probabilities for the loss after the episode, in a fixed
order: the policy has not changed meanwhile, so they are the ones the actions were drawn
with, and the autograd graph (whose node order decides the order in which a parameter's
gradient terms are added) no longer depends on which call came first."""

from __future__ import annotations

import threading
from typing import Any

import torch
from examples.rpc_programs._api import Api, Result, api, join
from torch import nn

EPISODES, EPISODE_STEPS, GAMMA = 4, 6, 0.9
_api: list[Api] = []


def _call_method(method: Any, rref: Any, *args: Any) -> Any:
    return method(rref.local_value(), *args)


def _remote_method(method: Any, rref: Any, *args: Any) -> Any:
    return _api[0].rpc.rpc_sync(rref.owner(), _call_method, args=(method, rref, *args))


class ToyEnv:
    """A 4-number state drifting with the action; reward: how close the state stays to 0."""

    def __init__(self, seed: int) -> None:
        self.g = torch.Generator().manual_seed(seed)
        self.state = torch.zeros(4)

    def reset(self) -> torch.Tensor:
        self.state = torch.randn(4, generator=self.g) * 0.1
        return self.state

    def step(self, action: int) -> tuple[torch.Tensor, float]:
        push = torch.tensor([0.1, -0.05, 0.02, 0.0]) * (1 if action else -1)
        self.state = self.state * 0.9 + push + torch.randn(4, generator=self.g) * 0.01
        return self.state, float(1.0 - self.state.abs().sum())


class Observer:
    def __init__(self, seed: int) -> None:
        self.env = ToyEnv(seed)
        self.id = seed

    def run_episode(self, agent_rref: Any) -> None:
        state = self.env.reset()
        for _ in range(EPISODE_STEPS):
            action = _remote_method(Agent.select_action, agent_rref, self.id, state)
            state, reward = self.env.step(action)
            _remote_method(Agent.report_reward, agent_rref, self.id, reward)


class Agent:
    def __init__(self, world_size: int) -> None:
        rpc = _api[0].rpc
        torch.manual_seed(0)
        self.policy = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
        self.optimizer = torch.optim.SGD(self.policy.parameters(), lr=0.05)
        self.agent_rref = rpc.RRef(self)
        self.observers = [
            rpc.remote(f"worker{r}", Observer, args=(r,)) for r in range(1, world_size)
        ]
        ids = range(1, world_size)
        self.generators = {i: torch.Generator().manual_seed(100 + i) for i in ids}
        self.seen: dict[int, list[tuple[torch.Tensor, int]]] = {i: [] for i in ids}
        self.rewards: dict[int, list[float]] = {i: [] for i in ids}
        self.lock = threading.Lock()  # observers call on several RPC threads

    def select_action(self, ob_id: int, state: torch.Tensor) -> int:
        with torch.no_grad():
            probs = torch.softmax(self.policy(state), dim=-1)
        with self.lock:
            action = int(torch.multinomial(probs, 1, generator=self.generators[ob_id]))
            self.seen[ob_id].append((state, action))
        return action

    def report_reward(self, ob_id: int, reward: float) -> None:
        with self.lock:
            self.rewards[ob_id].append(reward)

    def run_episode(self) -> None:
        futures = [
            _api[0].rpc.rpc_async(
                ob.owner(), _call_method, args=(Observer.run_episode, ob, self.agent_rref)
            )
            for ob in self.observers
        ]
        for future in futures:
            future.wait()

    def finish_episode(self) -> torch.Tensor:
        terms = []
        for ob_id in sorted(self.rewards):  # a fixed order: the same sum in every run
            returns, running = [], 0.0
            for r in reversed(self.rewards[ob_id]):
                running = r + GAMMA * running
                returns.insert(0, running)
            ret = torch.tensor(returns)
            ret = (ret - ret.mean()) / (ret.std() + 1e-6)
            states = torch.stack([state for state, _ in self.seen[ob_id]])
            actions = torch.tensor([action for _, action in self.seen[ob_id]])
            log_probs = torch.log_softmax(self.policy(states), dim=-1)[range(len(ret)), actions]
            terms.append(-(log_probs * ret).sum())
            self.seen[ob_id], self.rewards[ob_id] = [], []
        loss = torch.stack(terms).sum()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return loss


def run(rank: int, world_size: int, mode: str, folder: str) -> Result:
    _api[:] = [api(mode)]
    join(_api[0], rank, world_size, folder)
    result = Result()
    if rank == 0:
        agent = Agent(world_size)
        for _ in range(EPISODES):
            with result.timed():
                agent.run_episode()
                loss = agent.finish_episode()
            result.record(loss=loss, policy=list(agent.policy.parameters()))
    _api[0].rpc.shutdown()
    return result
