package ckpt

import (
	"fmt"
	"strconv"
	"strings"
	"time"
)

// idTimeLayout is fixed-width and UTC, so ids sort by time as plain strings.
const idTimeLayout = "20060102T150405.000Z"

const seqDigits = 6

// MaxIDLen is the longest snapshot id: its time, a node name of MaxNameLen bytes and its sequence.
const MaxIDLen = len(idTimeLayout) + 1 + MaxNameLen + 1 + seqDigits

// SnapshotID is a parsed snapshot id: <UTC time to the ms>-<node>-<seq>,
// e.g. 20261122T153000.123Z-node1-000042.
type SnapshotID struct {
	Time time.Time
	Node string
	Seq  uint64
}

// String formats the id; ids of one node sort by time, then sequence.
func (id SnapshotID) String() string {
	return fmt.Sprintf("%s-%s-%0*d", id.Time.UTC().Format(idTimeLayout), id.Node, seqDigits, id.Seq)
}

// ParseID parses a snapshot id and checks its node name.
func ParseID(s string) (SnapshotID, error) {
	n := len(idTimeLayout)
	if len(s) < n+1+1+1+seqDigits || s[n] != '-' {
		return SnapshotID{}, fmt.Errorf("snapshot id %q: want <%s>-<node>-<%d-digit seq>", s, idTimeLayout, seqDigits)
	}
	t, err := time.Parse(idTimeLayout, s[:n])
	if err != nil {
		return SnapshotID{}, fmt.Errorf("snapshot id %q: time: %w", s, err)
	}
	rest := s[n+1:]
	j := strings.LastIndexByte(rest, '-')
	if j < 0 || len(rest)-j-1 != seqDigits {
		return SnapshotID{}, fmt.Errorf("snapshot id %q: want a %d-digit sequence at the end", s, seqDigits)
	}
	seq, err := strconv.ParseUint(rest[j+1:], 10, 64)
	if err != nil || rest[j+1] == '+' {
		return SnapshotID{}, fmt.Errorf("snapshot id %q: sequence is not a number", s)
	}
	id := SnapshotID{Time: t, Node: rest[:j], Seq: seq}
	if err := ValidName(id.Node); err != nil {
		return SnapshotID{}, fmt.Errorf("snapshot id %q: node: %w", s, err)
	}
	if id.String() != s {
		return SnapshotID{}, fmt.Errorf("snapshot id %q is not in canonical form", s)
	}
	return id, nil
}
