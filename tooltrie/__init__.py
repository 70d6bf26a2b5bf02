"""What an orchestrator or an operator runs: the Python client (`client`) and the `tooltrie` command (`cli`);
named like the command, and outside shared/ because neither service imports it."""
