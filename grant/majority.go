package grant

import (
	"errors"
	"fmt"
	"slices"
	"strings"
)

// ErrNoMajority means too few members answered with a grant: the restorer must not run the job.
var ErrNoMajority = errors.New("no majority granted the incarnation")

// Answer is one member's reply to a grant request.
type Answer struct {
	Member  string
	Granted bool
	// Conflict is the member's grant that stands in the way, when it refused.
	Conflict *Record
	// Err: no usable answer (unreachable, timed out, could not persist the grant).
	Err error
}

// Majority is how many of members must grant.
func Majority(members int) int { return members/2 + 1 }

// Tally is the outcome of a grant request sent to the non-failed members of the restorer's view.
type Tally struct {
	Members   int      // asked, the restorer included
	Granted   []string // members that granted
	Conflicts []Answer // members that refused: the job has that incarnation, or a newer one, elsewhere
	Silent    []Answer // members without a usable answer
}

// Count tallies the answers of members members (a member missing from answers counts as silent).
func Count(members int, answers []Answer) Tally {
	t := Tally{Members: members}
	for _, a := range answers {
		switch {
		case a.Err == nil && a.Granted:
			t.Granted = append(t.Granted, a.Member)
		case a.Err == nil && a.Conflict != nil:
			t.Conflicts = append(t.Conflicts, a)
		default:
			if a.Err == nil {
				a.Err = errors.New("neither granted nor refused")
			}
			t.Silent = append(t.Silent, a)
		}
	}
	return t
}

// Won reports whether the restorer may run the job: a majority granted and no member refused. A single
// refusal is enough to lose: it proves the incarnation is held elsewhere, and a majority of a changed view
// (members failed since the other holder's grant) need not include a member that knows of it.
func (t Tally) Won() bool {
	return len(t.Conflicts) == 0 && len(t.Granted) >= Majority(t.Members)
}

// Contended reports whether the refusals look like a concurrent restore of the same incarnation n that
// split the members with this one: every refusal is a grant of n, and no other holder has it from a
// majority (then it won). Both may have lost, so giving back and retrying can make progress.
func (t Tally) Contended(n uint64) bool {
	if len(t.Conflicts) == 0 {
		return false
	}
	type holder struct{ name, host string }
	held := map[holder]int{}
	for _, a := range t.Conflicts {
		if a.Conflict.Incarnation != n || a.Conflict.Released {
			return false
		}
		h := holder{a.Conflict.Holder, a.Conflict.Host}
		held[h]++
		if held[h] >= Majority(t.Members) {
			return false
		}
	}
	return true
}

// Highest is the newest incarnation among the refusals (0 without any).
func (t Tally) Highest() uint64 {
	var n uint64
	for _, a := range t.Conflicts {
		n = max(n, a.Conflict.Incarnation)
	}
	return n
}

// RefusedError says where the job runs: the newest grant that the refusing members recorded.
type RefusedError struct {
	Job    string
	Asked  uint64
	Record Record
	By     []string // members that recorded Record
	All    []Record // every refusing member's record, Record among them
}

// OnlyOn reports whether every refusal not given back is a grant to a restore on host: whether superseding
// them (a restore that host's failure cut short) can make no copy that runs elsewhere a second one.
func (e *RefusedError) OnlyOn(host string) bool {
	for _, r := range e.All {
		if !r.Released && r.Host != host {
			return false
		}
	}
	return len(e.All) > 0
}

func (e *RefusedError) Error() string {
	by := strings.Join(e.By, ", ")
	if e.Record.Released {
		return fmt.Sprintf("job %s: incarnation %d was granted to %s on %s (%s; recorded by %s) and given back unused; this restore would be incarnation %d",
			e.Job, e.Record.Incarnation, e.Record.Holder, e.Record.Host, clock(e.Record.Granted), by, e.Asked)
	}
	return fmt.Sprintf("job %s already runs as incarnation %d on %s (granted %s to %s; recorded by %s)",
		e.Job, e.Record.Incarnation, e.Record.Host, clock(e.Record.Granted), e.Record.Holder, by)
}

func (e *RefusedError) Unwrap() error { return ErrConflict }

// Err is nil if the restorer won; else a *RefusedError naming the newest conflicting grant, or an
// ErrNoMajority error listing the members that did not answer.
func (t Tally) Err(job string, n uint64) error {
	if t.Won() {
		return nil
	}
	if len(t.Conflicts) > 0 {
		best := *t.Conflicts[0].Conflict
		for _, a := range t.Conflicts[1:] {
			if c := *a.Conflict; c.Incarnation > best.Incarnation || c.Incarnation == best.Incarnation && c.Granted.After(best.Granted) {
				best = c
			}
		}
		e := &RefusedError{Job: job, Asked: n, Record: best}
		for _, a := range t.Conflicts {
			c := *a.Conflict
			e.All = append(e.All, c)
			if c.Incarnation == best.Incarnation && c.Holder == best.Holder && c.Host == best.Host {
				e.By = append(e.By, a.Member)
			}
		}
		slices.Sort(e.By)
		return e
	}
	var why []string
	for _, a := range t.Silent {
		why = append(why, fmt.Sprintf("%s: %v", a.Member, a.Err))
	}
	return fmt.Errorf("%w: job %s incarnation %d: %d of %d members granted, %d needed (%s)",
		ErrNoMajority, job, n, len(t.Granted), t.Members, Majority(t.Members), strings.Join(why, "; "))
}
