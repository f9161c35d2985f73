"""Model updates on the agent: repository transports, TUF verification and the persisted
update state machine (DESIGN 4.4, 4.5)."""
