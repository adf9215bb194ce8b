"""Staleness manager, prompt ledger, async controller, policy-version bookkeeping."""
