"""Agents as workflows: a user's ordinary chat loop against an OpenAI-compatible client, run
over any RolloutEngine, turned into token-exact trajectories (docs/agents.md).

Imports nothing heavy (config validation imports the workflow registry); the ``openai``
package is imported when a run makes its client."""

from .metrics import agent_metrics, runs
from .spec import AgentError, AgentSpec, agent_spec
from .trajectories import Turn, run_trajectories
from .workflow import AgentRunFailed, AgentWorkflow, base_url, openai_client

__all__ = ["AgentError", "AgentRunFailed", "AgentSpec", "AgentWorkflow", "Turn", "agent_metrics", "agent_spec",
           "base_url", "openai_client", "run_trajectories", "runs"]
