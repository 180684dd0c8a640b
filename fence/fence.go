// Package fence keeps a cut-off host's jobs from running twice: the pure timing rules by which a node
// fences itself and its protector waits for that, and the runner of a site's fence command (IPMI,
// Redfish, a PDU) that confirms a host is off.
//
// Both sides measure durations on their own monotonic clock, never compare wall clocks across hosts. The
// shared event is the cut: the protector's last received heartbeat arrived before it, and the victim's
// last confirmed contact with its protector (a beat whose bytes the protector's host acknowledged) was
// sent before it too, at most one heartbeat interval after that beat arrived (beats go out every interval). So the victim has
// fenced by lastBeat + Interval + FenceTimeout + Check + KillBound on any clock running at the same rate;
// Margin adds that plus a rate allowance.
package fence

import (
	"fmt"
	"time"
)

// Timing is what both sides of the fence agree on (the same cluster configuration).
type Timing struct {
	Interval time.Duration // heartbeat interval
	Timeout  time.Duration // fence timeout: silence from both ring neighbours before a node fences itself
}

// KillBound is how long a fencing node may take from deciding to fence until its jobs are gone: one write
// to cgroup.kill, then the kernel tears the processes down.
const KillBound = time.Second

// Check is how often a node checks whether it must fence itself.
func (t Timing) Check() time.Duration { return t.Interval / 2 }

// Margin is what the protector adds to the fence timeout, measured from the victim's last heartbeat: the
// victim's newest acknowledged write may be one interval younger than that beat (the next beat, received
// in part), its check runs every Check, the kill takes up to KillBound, and two hosts' clocks may tick at
// slightly different rates (NTP slews by at most 500 ppm; 1% leaves room).
func (t Timing) Margin() time.Duration {
	return t.Interval + t.Check() + KillBound + t.Timeout/100
}

// Validate checks that the fence timeout fits the heartbeat timing.
func (t Timing) Validate(heartbeatTimeout time.Duration) error {
	if t.Interval <= 0 {
		return fmt.Errorf("heartbeat interval %s must be positive", t.Interval)
	}
	// A node must not fence itself on a blip its protector would not even suspect: the protector declares
	// a failure only after heartbeat.timeout of silence plus a confirmation probe of up to as long again.
	if t.Timeout < 2*heartbeatTimeout {
		return fmt.Errorf("fence_timeout %s is shorter than twice heartbeat.timeout (%s): a node would kill its jobs before its protector could declare it failed; use at least %s",
			t.Timeout, heartbeatTimeout, 2*heartbeatTimeout)
	}
	return nil
}

// Contact is when a node last heard from each ring neighbour, on its own monotonic clock (zero: never
// since it started watching).
type Contact struct {
	Protector   time.Time // its protector answered a probe sent then
	Predecessor time.Time // a heartbeat of its predecessor arrived then
}

// Decision is the outcome of one check.
type Decision struct {
	Fence   bool
	Silence time.Duration // since the most recent contact with either neighbour
}

// Decide reports whether a node must fence itself now: it has heard from neither its protector nor its
// predecessor for at least timeout. Losing only one is not isolation by itself: that neighbour failed, and
// the other side of the ring handles it (unless the node is in a minority: AskMembersAfter). since is when
// the node started watching (contact before that does not exist yet, so silence counts from it).
func Decide(now, since time.Time, c Contact, timeout time.Duration) Decision {
	last := since
	for _, t := range []time.Time{c.Protector, c.Predecessor} {
		if t.After(last) {
			last = t
		}
	}
	s := now.Sub(last)
	return Decision{Fence: s >= timeout, Silence: s}
}

// AskMembersAfter is how long into its protector's silence a node that still hears its predecessor starts
// asking whether it reaches the other members (a node in a minority fences itself on its protector's silence
// alone): early enough that an answer bounded by probe is in when the silence reaches the fence timeout.
func (t Timing) AskMembersAfter(probe time.Duration) time.Duration {
	return max(t.Timeout-probe-2*t.Check(), 0)
}

// VouchBy is how long a node that finds itself cut off (Decide) after a stall of its own may wait for its
// protector's vouch (OpVouch) before it kills its jobs: until the kill must begin for the jobs to be gone
// when the protector's restored copies may go live (ReadyAt), half of KillBound left for the kill, counted
// from the node's last contact with its protector (since, when it has none). A node that woke up later
// than that still asks, for Check at most: if its protector declared it, its copies may run already, and
// the protector answers "no" in a round trip; if its protector stalled too (a paused machine or cluster),
// nobody declared it, and the answer keeps its jobs. A vouch is contact on both sides: the node counts it
// from when it asked, the protector from when it answered, later, so ReadyAt's rule holds from it too.
func (t Timing) VouchBy(now, since, protector time.Time) time.Time {
	base := since
	if protector.After(base) {
		base = protector
	}
	by := base.Add(t.Timeout + t.Check() + KillBound/2)
	if floor := now.Add(t.Check()); by.Before(floor) {
		return floor
	}
	return by
}

// ReadyAt is when the protector may let a restored copy of a node go live: once the node has surely
// fenced itself, measured from the last heartbeat that arrived from it.
func (t Timing) ReadyAt(lastBeat time.Time) time.Time {
	return lastBeat.Add(t.Timeout + t.Margin())
}
