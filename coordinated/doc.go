// Package coordinated takes coordinated snapshots ("cuts") of a run and rolls a whole run back to one
// (issue 11): for a program message logging cannot replay exactly (it decides from the clock, or from
// which messages had arrived), the run's jobs, on every host, are frozen before any is dumped and thawed
// only once all are: every byte between them is then in exactly one snapshot's socket queues, which the
// coordinator checks from the snapshots' sequence numbers before it records the cut. A rollback stops
// every job of the run (its address off the wire first, so its peers see nothing) before any is restored
// from the cut, each on its host.
//
// The package holds the protocol's coordinator (Coordinator), the records of cuts a host keeps (Records),
// the holds of a host that froze a run's jobs for a coordinator (Holds), and the pure decisions between
// them (Check, Place). What each phase does to a host's jobs (freeze, dump, thaw, stop, restore) is the
// agent's, which serves the phases (clusterapi.CoordinateRequest) and implements Members.
package coordinated
