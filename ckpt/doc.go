// Package ckpt stores durable, verifiable CRIU snapshots.
//
// Layout: <root>/<job>/<snapshot-id>/ holds the CRIU image files plus
// manifest.json, which lists every file with its size and sha256 and carries
// what a restorer needs (TCP connection state, open files, dump stats,
// replicas). A snapshot is written into a hidden, flock'ed temp directory and
// becomes visible only through one rename after every file, the manifest and
// the directories are fsynced; Open removes temp directories of dead writers,
// so a crash never leaves a visible half snapshot. A received copy that
// replaces a damaged or different local one (BeginReplace) is swapped in
// with renameat2 RENAME_EXCHANGE only after it verified, so the old copy
// stays until then.
//
// Snapshots hold process memory: every directory of a store is 0700 and
// every file 0600, whatever mode the dumper or the sender used; Open
// restricts a store an older version left world-readable.
//
// Ids sort by time: 20261122T153000.123Z-<node>-<seq>. A protector keeps its
// own snapshots and those it receives under the same job directory, so the
// listing calls take an optional node filter, and retention works per node.
package ckpt
