package e2e

import (
	"strings"
	"sync"
	"testing"
)

// How many of the package's labs run at once. Go's own limit on parallel tests (GOMAXPROCS, 2 here) kept
// the labs two at a time while the machine was 20-70% busy: most of a lab's time is spent waiting
// (detection, fencing, transfers, the programs' own pacing). Three at a time took the package from 1587 s
// to 1321 s in CI (ci269, ci271). MPI programs compute and poll for their messages on every core they get:
// two MPI labs at once beside a third lab slowed HPCC's run 1.5-fold (144 s against 93 s), past its bound,
// so one at a time. TestMain lifts go's own limit, and these slots bound the labs instead.
const (
	maxLabs    = 3
	maxMPILabs = 1
)

// slots is the package's one gate: its tests run in one process and share the machine.
var slots = newLabSlots(maxLabs, maxMPILabs)

// slotCount is how many labs run (labs, mpi of them with MPI programs) and how many MPI labs wait.
type slotCount struct {
	labs, mpi, mpiWaiting int
}

// fits says whether a lab (an MPI one if mpi) may start now, within maxLabs and maxMPI. A waiting MPI lab
// that fits gets the next slot before any other: otherwise the short tests, always ready, would hold the
// slots until the end and leave the long MPI runs last.
func (c slotCount) fits(mpi bool, maxLabs, maxMPI int) bool {
	switch {
	case c.labs >= maxLabs:
		return false
	case mpi:
		return c.mpi < maxMPI
	default:
		return c.mpiWaiting == 0 || c.mpi >= maxMPI
	}
}

// labSlots is the gate newLab passes before it makes a lab.
type labSlots struct {
	maxLabs, maxMPI int

	mu      sync.Mutex
	changed *sync.Cond
	count   slotCount
	holders map[string]bool // by test name: a subtest runs in its parent's slot
}

func newLabSlots(maxLabs, maxMPI int) *labSlots {
	s := &labSlots{maxLabs: maxLabs, maxMPI: maxMPI, holders: map[string]bool{}}
	s.changed = sync.NewCond(&s.mu)
	return s
}

// take waits for a slot for t's lab (mpi: it runs MPI programs) and gives it back when t ends, after the
// lab's own cleanup (registered later, so run earlier). A test, or a subtest of one, that holds a slot
// already makes its next lab in the same slot.
func (s *labSlots) take(t *testing.T, mpi bool) {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	for name := t.Name(); ; {
		if s.holders[name] {
			return
		}
		i := strings.LastIndexByte(name, '/')
		if i < 0 {
			break
		}
		name = name[:i]
	}
	if mpi {
		s.count.mpiWaiting++
	}
	for !s.count.fits(mpi, s.maxLabs, s.maxMPI) {
		s.changed.Wait()
	}
	s.count.labs++
	if mpi {
		s.count.mpiWaiting--
		s.count.mpi++
	}
	s.holders[t.Name()] = true
	t.Cleanup(func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		delete(s.holders, t.Name())
		s.count.labs--
		if mpi {
			s.count.mpi--
		}
		s.changed.Broadcast()
	})
}

func TestLabSlotsFits(t *testing.T) {
	for _, tc := range []struct {
		name string
		c    slotCount
		mpi  bool
		want bool
	}{
		{"empty", slotCount{}, false, true},
		{"empty, mpi", slotCount{}, true, true},
		{"full", slotCount{labs: 3}, false, false},
		{"full, mpi", slotCount{labs: 3}, true, false},
		{"room, but an mpi lab runs", slotCount{labs: 1, mpi: 1}, true, false},
		{"room for a plain lab beside the mpi one", slotCount{labs: 2, mpi: 1}, false, true},
		{"an mpi lab waits and fits: it goes first", slotCount{labs: 1, mpiWaiting: 1}, false, false},
		{"an mpi lab waits but cannot run: others go", slotCount{labs: 1, mpi: 1, mpiWaiting: 1}, false, true},
		{"the waiting mpi lab itself", slotCount{labs: 1, mpiWaiting: 1}, true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.c.fits(tc.mpi, maxLabs, maxMPILabs); got != tc.want {
				t.Errorf("%+v.fits(mpi %v) = %v, want %v", tc.c, tc.mpi, got, tc.want)
			}
		})
	}
}
