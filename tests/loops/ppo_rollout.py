# Shape: vwxyzjn/cleanrl cleanrl/ppo.py — per update: anneal lr; rollout of num_steps with the agent under torch.no_grad (actor + critic), envs.step; bootstrap value under no_grad and GAE; then update_epochs x minibatches of get_action_and_value, clipped losses, zero_grad, backward, clip_grad_norm_, optimizer.step(); then logging.
"""PPO: every rollout forward (``agent.get_action_and_value`` under ``no_grad``, which
runs the actor and the critic on the same observations) is one eval step, and so is the
bootstrap ``agent.get_value``; every minibatch update is one training step with one
micro-batch. A tiny vectorised CartPole (numpy) stands in for gym's SyncVectorEnv.
Planted: a slow ``envs.step`` after each rollout forward (eval ``untracked``; the
simulator's own work and the storing of its results are timed with it) and a
slow writer flush after each update phase (train ``untracked`` of the update's last
step). The advantage (GAE) computation after the bootstrap forward is timed as user
code of that eval step. The rest of the user code that lands in ``untracked`` is timed
too: in a train step, the ratio and KL terms after the critic forward, the losses and
``zero_grad`` after the ``.item()`` (``Categorical`` between the actor and the critic,
and ``clip_grad_norm_`` between backward and update, lie inside ``train_batch``), and
its tail up to the next forward (the minibatch indices and ``explained_variance``,
the lr annealing and the first rollout stores of the next update); in an eval step,
storing the forward's results. The tail before a minibatch's forward belongs to the
step before it: the bootstrap eval step for the update's first minibatch."""

import random

import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
from torch.distributions.categorical import Categorical

from _truth import BEFORE, EVAL, TRAIN, Truth

torch.set_num_threads(1)  # not in the original: keeps a 2-core machine steady
truth = Truth("ppo_rollout")
NUM_ENVS, NUM_STEPS, NUM_UPDATES, UPDATE_EPOCHS, NUM_MINIBATCHES = 2, 12, 3, 2, 4
BATCH_SIZE = NUM_ENVS * NUM_STEPS
MINIBATCH_SIZE = BATCH_SIZE // NUM_MINIBATCHES
LR, GAMMA, GAE_LAMBDA, CLIP_COEF, ENT_COEF, VF_COEF, MAX_GRAD_NORM = 2.5e-4, 0.99, 0.95, 0.2, 0.01, 0.5, 0.5
ENV_DELAY, WRITER_DELAY = 0.020, 0.160


class VecCartPole:
    """NUM_ENVS CartPoles with auto-reset, like gym.vector.SyncVectorEnv."""

    def __init__(self, n, seed):
        self.rng = np.random.default_rng(seed)
        self.n = n

    def reset(self):
        self.state = self.rng.uniform(-0.05, 0.05, size=(self.n, 4))
        return self.state.astype(np.float32)

    def step(self, action):
        truth.sleep(EVAL, "untracked", ENV_DELAY)  # the simulator's own time
        x, x_dot, theta, theta_dot = self.state.T
        force = np.where(action == 1, 10.0, -10.0)
        costheta, sintheta = np.cos(theta), np.sin(theta)
        temp = (force + 0.05 * theta_dot ** 2 * sintheta) / 1.1
        thetaacc = (9.8 * sintheta - costheta * temp) / (0.5 * (4.0 / 3.0 - 0.1 * costheta ** 2 / 1.1))
        xacc = temp - 0.05 * thetaacc * costheta / 1.1
        self.state = np.stack([x + 0.02 * x_dot, x_dot + 0.02 * xacc, theta + 0.02 * theta_dot,
                               theta_dot + 0.02 * thetaacc], axis=1)
        done = (np.abs(self.state[:, 0]) > 2.4) | (np.abs(self.state[:, 2]) > 0.2095)
        self.state[done] = self.rng.uniform(-0.05, 0.05, size=(int(done.sum()), 4))
        return self.state.astype(np.float32), np.ones(self.n), done, [{} for _ in range(self.n)]


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self):
        super().__init__()
        self.critic = nn.Sequential(layer_init(nn.Linear(4, 32)), nn.Tanh(), layer_init(nn.Linear(32, 1), std=1.0))
        self.actor = nn.Sequential(layer_init(nn.Linear(4, 32)), nn.Tanh(), layer_init(nn.Linear(32, 2), std=0.01))

    def get_value(self, x):
        return self.critic(x)

    def get_action_and_value(self, x, action=None):
        logits = self.actor(x)
        probs = Categorical(logits=logits)
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)


random.seed(1)
np.random.seed(1)
torch.manual_seed(1)
envs = VecCartPole(NUM_ENVS, seed=1)
agent = Agent()
optimizer = optim.Adam(agent.parameters(), lr=LR, eps=1e-5)
obs = torch.zeros((NUM_STEPS, NUM_ENVS, 4))
actions = torch.zeros((NUM_STEPS, NUM_ENVS))
logprobs = torch.zeros((NUM_STEPS, NUM_ENVS))
rewards = torch.zeros((NUM_STEPS, NUM_ENVS))
dones = torch.zeros((NUM_STEPS, NUM_ENVS))
values = torch.zeros((NUM_STEPS, NUM_ENVS))

global_step = 0
next_obs = torch.Tensor(envs.reset())
next_done = torch.zeros(NUM_ENVS)
truth.start()
for update in range(1, NUM_UPDATES + 1):
    with truth.timed(TRAIN if update > 1 else BEFORE, "untracked"):  # the last update's last train step
        frac = 1.0 - (update - 1.0) / NUM_UPDATES
        optimizer.param_groups[0]["lr"] = frac * LR

    for step in range(0, NUM_STEPS):
        with truth.timed(EVAL if step else TRAIN if update > 1 else BEFORE, "untracked"):  # the step before
            global_step += NUM_ENVS
            obs[step] = next_obs
            dones[step] = next_done
        with torch.no_grad():
            action, logprob, _, value = agent.get_action_and_value(next_obs)
            with truth.timed(EVAL, "untracked"):
                values[step] = value.flatten()
        truth.eval_step()
        with truth.timed(EVAL, "untracked"):
            actions[step] = action
            logprobs[step] = logprob
        cpu_action = action.cpu().numpy()  # (a from_device phase, not user code)
        with truth.timed(EVAL, "untracked"):  # the simulator and the storage of its results
            next_obs, reward, done, info = envs.step(cpu_action)
            rewards[step] = torch.tensor(reward).view(-1)
            next_obs, next_done = torch.Tensor(next_obs), torch.Tensor(done.astype(np.float32))

    with torch.no_grad():
        next_value = agent.get_value(next_obs).reshape(1, -1)
        truth.eval_step()
        with truth.timed(EVAL, "untracked"):  # GAE: user code in the bootstrap eval step's tail
            advantages = torch.zeros_like(rewards)
            lastgaelam = 0
            for t in reversed(range(NUM_STEPS)):
                if t == NUM_STEPS - 1:
                    nextnonterminal = 1.0 - next_done
                    nextvalues = next_value
                else:
                    nextnonterminal = 1.0 - dones[t + 1]
                    nextvalues = values[t + 1]
                delta = rewards[t] + GAMMA * nextvalues * nextnonterminal - values[t]
                advantages[t] = lastgaelam = delta + GAMMA * GAE_LAMBDA * nextnonterminal * lastgaelam
            returns = advantages + values

    with truth.timed(EVAL, "untracked"):
        b_obs = obs.reshape((-1, 4))
        b_logprobs = logprobs.reshape(-1)
        b_actions = actions.reshape(-1)
        b_advantages = advantages.reshape(-1)
        b_returns = returns.reshape(-1)
        b_values = values.reshape(-1)
        b_inds = np.arange(BATCH_SIZE)
        clipfracs = []
    for epoch in range(UPDATE_EPOCHS):
        with truth.timed(TRAIN if epoch else EVAL, "untracked"):  # the tail of the step before
            np.random.shuffle(b_inds)
        for start in range(0, BATCH_SIZE, MINIBATCH_SIZE):
            with truth.timed(TRAIN if epoch or start else EVAL, "untracked"):  # the tail of the step before
                mb_inds = b_inds[start:start + MINIBATCH_SIZE]
                mb_obs, mb_actions = b_obs[mb_inds], b_actions.long()[mb_inds]
            _, newlogprob, entropy, newvalue = agent.get_action_and_value(mb_obs, mb_actions)
            with truth.timed(TRAIN, "untracked"):  # after the critic forward, before the .item()
                logratio = newlogprob - b_logprobs[mb_inds]
                ratio = logratio.exp()
                with torch.no_grad():
                    old_approx_kl = (-logratio).mean()
                    approx_kl = ((ratio - 1) - logratio).mean()
                    clipfrac = ((ratio - 1.0).abs() > CLIP_COEF).float().mean()
            clipfracs += [clipfrac.item()]
            with truth.timed(TRAIN, "untracked"):  # the losses, up to the backward
                mb_advantages = b_advantages[mb_inds]
                mb_advantages = (mb_advantages - mb_advantages.mean()) / (mb_advantages.std() + 1e-8)
                pg_loss = torch.max(-mb_advantages * ratio,
                                    -mb_advantages * torch.clamp(ratio, 1 - CLIP_COEF, 1 + CLIP_COEF)).mean()
                newvalue = newvalue.view(-1)
                v_loss = 0.5 * ((newvalue - b_returns[mb_inds]) ** 2).mean()
                entropy_loss = entropy.mean()
                loss = pg_loss - ENT_COEF * entropy_loss + v_loss * VF_COEF
                optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(agent.parameters(), MAX_GRAD_NORM)
            optimizer.step()
            truth.train_step(microbatches=1)

    y_pred, y_true = b_values.cpu().numpy(), b_returns.cpu().numpy()
    with truth.timed(TRAIN, "untracked"):
        var_y = np.var(y_true)
        explained_var = np.nan if var_y == 0 else 1 - np.var(y_true - y_pred) / var_y
    print(f"update {update}: value_loss {v_loss.item():.3f} policy_loss {pg_loss.item():.3f} "
          f"approx_kl {approx_kl.item():.4f} explained_variance {explained_var:.3f}")
    truth.sleep(TRAIN, "untracked", WRITER_DELAY)  # writer.add_scalar(...) x 8, a tensorboard flush
truth.stop()
truth.emit()
