"""Agents as workflows: a user's ordinary chat loop against an OpenAI-compatible client, run
over any RolloutEngine, turned into token-exact trajectories (docs/agents.md).

Imports nothing heavy (config validation imports the workflow registry); the ``openai``
package is imported when a run makes its client."""

from .trajectories import Turn, run_trajectories
from .workflow import AgentError, AgentSpec, AgentWorkflow, agent_spec, base_url, openai_client

__all__ = ["AgentError", "AgentSpec", "AgentWorkflow", "Turn", "agent_spec", "base_url", "openai_client",
           "run_trajectories"]
