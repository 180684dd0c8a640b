// Package agent is ftkit's node daemon: it protects the jobs of one host (snapshots, shipping to the
// protector, the eBPF log) and serves the local API that ftctl and ftwrap use.
package agent
