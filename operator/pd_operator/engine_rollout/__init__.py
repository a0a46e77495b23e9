"""Engine rollouts and the instances they act on: a role's engine instances created, replaced
and deleted one by one, and a change of their template rolled over both roles without failing
a request (`planner` and `steps`, pure; `pods`, what they read of the fleet), with each
revision's template kept for a rollback and the API writes made by `executor`."""
