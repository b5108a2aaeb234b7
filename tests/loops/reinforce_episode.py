# Shape: pytorch/examples reinforcement_learning/reinforce.py — per episode: env.reset(), select_action() (a policy forward WITH grad) on every env step, then finish_episode(): discounted returns, optimizer.zero_grad(), policy_loss.backward(), optimizer.step(); log every log_interval.
"""REINFORCE: the forwards during the episode keep their graphs for the single backward
at its end, so the whole episode is one training step with one micro-batch. A tiny
CartPole (same dynamics, numpy) stands in for gymnasium's. Planted: a slow log line
after every episode's update (``untracked``). The rest of the episode's own user code
lands in the same ``untracked`` (the simulator, ``Categorical`` sampling, the
discounted returns and the loss sum, ``zero_grad``, the log line itself) and is timed
with it: everything but the policy forward, ``.item()``, ``backward()`` and
``optimizer.step()``."""

from collections import deque

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.distributions import Categorical

from _truth import BEFORE, TRAIN, Truth

torch.set_num_threads(1)  # not in the original: keeps a 2-core machine steady
truth = Truth("reinforce_episode")
GAMMA, EPISODES, LOG_INTERVAL, LOG_DELAY, MAX_T = 0.99, 16, 1, 0.025, 40


class CartPole:
    """CartPole-v1 dynamics (Euler), terminating like gymnasium's."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def reset(self):
        self.state = self.rng.uniform(-0.05, 0.05, size=4)
        return self.state.astype(np.float32), {}

    def step(self, action):
        x, x_dot, theta, theta_dot = self.state
        force = 10.0 if action == 1 else -10.0
        costheta, sintheta = np.cos(theta), np.sin(theta)
        temp = (force + 0.05 * theta_dot ** 2 * sintheta) / 1.1
        thetaacc = (9.8 * sintheta - costheta * temp) / (0.5 * (4.0 / 3.0 - 0.1 * costheta ** 2 / 1.1))
        xacc = temp - 0.05 * thetaacc * costheta / 1.1
        x, x_dot = x + 0.02 * x_dot, x_dot + 0.02 * xacc
        theta, theta_dot = theta + 0.02 * theta_dot, theta_dot + 0.02 * thetaacc
        self.state = np.array([x, x_dot, theta, theta_dot])
        terminated = bool(abs(x) > 2.4 or abs(theta) > 12 * 2 * np.pi / 360)
        return self.state.astype(np.float32), 1.0, terminated, False, {}


class Policy(nn.Module):
    def __init__(self):
        super().__init__()
        self.affine1 = nn.Linear(4, 32)
        self.dropout = nn.Dropout(p=0.6)
        self.affine2 = nn.Linear(32, 2)
        self.saved_log_probs = []
        self.rewards = []

    def forward(self, x):
        x = F.relu(self.dropout(self.affine1(x)))
        return F.softmax(self.affine2(x), dim=1)


env = CartPole(seed=543)
torch.manual_seed(543)
policy = Policy()
optimizer = optim.Adam(policy.parameters(), lr=1e-2)
eps = np.finfo(np.float32).eps.item()


def select_action(state):
    with truth.timed(TRAIN, "untracked"):
        state = torch.from_numpy(state).float().unsqueeze(0)
    probs = policy(state)
    with truth.timed(TRAIN, "untracked"):  # sampling: user code, not the forward
        m = Categorical(probs)
        action = m.sample()
        policy.saved_log_probs.append(m.log_prob(action))
    return action.item()


def finish_episode():
    with truth.timed(TRAIN, "untracked"):  # returns and the loss: user code
        R = 0
        policy_loss = []
        returns = deque()
        for r in policy.rewards[::-1]:
            R = r + GAMMA * R
            returns.appendleft(R)
        returns = torch.tensor(returns)
        returns = (returns - returns.mean()) / (returns.std() + eps)
        for log_prob, R in zip(policy.saved_log_probs, returns):
            policy_loss.append(-log_prob * R)
        optimizer.zero_grad()
        policy_loss = torch.cat(policy_loss).sum()
    policy_loss.backward()
    optimizer.step()
    truth.train_step(microbatches=1)
    with truth.timed(TRAIN, "untracked"):
        del policy.rewards[:]
        del policy.saved_log_probs[:]


running_reward = 10
truth.start()
for i_episode in range(1, EPISODES + 1):
    with truth.timed(TRAIN if i_episode > 1 else BEFORE, "untracked"):  # the tail of the last episode
        state, _ = env.reset()
        ep_reward = 0
    for t in range(1, MAX_T + 1):  # the original allows 10000 env steps; a short cap keeps episodes small
        action = select_action(state)
        with truth.timed(TRAIN, "untracked"):  # the simulator
            state, reward, terminated, truncated, _ = env.step(action)
            policy.rewards.append(reward)
            ep_reward += reward
        if terminated or truncated:
            break
    with truth.timed(TRAIN, "untracked"):
        running_reward = 0.05 * ep_reward + (1 - 0.05) * running_reward
    finish_episode()
    if i_episode % LOG_INTERVAL == 0:
        with truth.timed(TRAIN, "untracked"):
            print(f"Episode {i_episode}\tLast reward: {ep_reward:.2f}\tAverage reward: {running_reward:.2f}")
            truth.sleep(TRAIN, "untracked", LOG_DELAY)
truth.stop()
truth.emit()
