// Package recovery runs the target's part of a fail-over: it restores a failed node's jobs on this host
// from their snapshots and the surviving peers' logs, and does not let one run on unless every byte it
// re-sent matches what its peers received.
//
// Run is the whole recovery as one sequence of steps (fetch, plan and rewrite, network, restore,
// announce, replay wait and verification, re-protection), reporting a Stage for each. The mechanics come
// from package restore (plan, rewrite, guard, address take-over); what only the agent can do (fetch a
// snapshot, ask a peer, read its own log, run a job under a shim, claim an incarnation, persist the
// recovery for a resume) is behind the small interfaces of Deps, which the agent implements.
package recovery
