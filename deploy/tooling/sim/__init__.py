"""``mcp-sim``: thousands of simulated devices in one process, speaking the real protocol.

Each simulated device enrolls with the real control plane (its own Ed25519 key,
``POST /api/v1/enroll``), holds its own MQTT session through Mosquitto with the credentials it
was given (the one MQTT adapter, :mod:`mcp_edge.shared.mqtt`, on one event loop), verifies
every desired state with the director keys, fetches the real TUF metadata and bundle from the
control plane's repository over MQTT, and reports events, its reported state, health and
inference statistics as the agent does. docs/simulator.md is the user's guide; the shortcut
that makes 10,000 devices fit on two cores (verdicts shared by content) is described in
:mod:`.repository`.

Modules: :mod:`.cli` (the command line), :mod:`.enroll`, :mod:`.fleet` (the state directory),
:mod:`.runner` (the fleet's loops and status), :mod:`.device` (one device's session),
:mod:`.deploy` (its deployments), :mod:`.repository` (TUF over MQTT, shared verdicts),
:mod:`.traffic` (statistics and health drawn per window), :mod:`.config` (the behaviour file).
"""
