package autogroup

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"slices"
	"strings"
	"syscall"
	"testing"
)

func TestParse(t *testing.T) {
	for _, c := range []struct {
		in   string
		want int
		ok   bool
	}{
		{"/autogroup-12 nice 0\n", 0, true},
		{"/autogroup-7 nice -10\n", -10, true},
		{"/autogroup-7 nice 19", 19, true},
		{"/autogroup-7 nice 20\n", 0, false},
		{"/autogroup-7 nice -21\n", 0, false},
		{"/autogroup-7 nice x\n", 0, false},
		{"/autogroup-7 prio 0\n", 0, false},
		{"autogroup nice 0\n", 0, false},
		{"", 0, false},
	} {
		got, err := parse(c.in)
		if (err == nil) != c.ok || got != c.want {
			t.Errorf("parse(%q) = %d, %v; want %d, ok %v", c.in, got, err, c.want, c.ok)
		}
	}
}

// fakeGroup is an autogroup whose changes a test reads back.
type fakeGroup struct {
	nice   int
	getErr error
	setErr error
	sets   []int
}

func (g *fakeGroup) raiser(nice int) *Raiser {
	r := NewRaiser(nice, slog.New(slog.DiscardHandler))
	r.get = func() (int, error) { return g.nice, g.getErr }
	r.set = func(n int) error {
		if g.setErr != nil {
			return g.setErr
		}
		g.sets = append(g.sets, n)
		g.nice = n
		return nil
	}
	return r
}

func TestRaiser(t *testing.T) {
	for _, c := range []struct {
		name     string
		g        fakeGroup
		raise    int
		sets     []int // every value set, in order, over two overlapping holds
		duringAt int   // the group's value while both are held
	}{
		{"raised once for overlapping holds, put back after the last", fakeGroup{nice: 0}, -10, []int{-10, 0}, -10},
		{"heartbeat.nice's group keeps its value after", fakeGroup{nice: -5}, -10, []int{-10, -5}, -10},
		{"a group already higher is left alone", fakeGroup{nice: -15}, -10, nil, -15},
		{"a group at the value is left alone", fakeGroup{nice: -10}, -10, nil, -10},
		{"no autogroup: nothing to do", fakeGroup{nice: 0, getErr: ErrNone}, -10, nil, 0},
		{"a refused change is not put back", fakeGroup{nice: 0, setErr: errors.New("EPERM")}, -10, nil, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			g := c.g
			r := g.raiser(c.raise)
			first := r.Hold()
			second := r.Hold()
			if g.nice != c.duringAt {
				t.Errorf("while held: nice %d, want %d", g.nice, c.duringAt)
			}
			first()
			first() // a second call of one release changes nothing
			if g.nice != c.duringAt {
				t.Errorf("while one hold is left: nice %d, want %d", g.nice, c.duringAt)
			}
			second()
			if !slices.Equal(g.sets, c.sets) {
				t.Errorf("values set %v, want %v", g.sets, c.sets)
			}
			// Held again, it raises again.
			r.Hold()()
			if want := append(slices.Clone(c.sets), c.sets...); !slices.Equal(g.sets, want) {
				t.Errorf("after a second round, values set %v, want %v", g.sets, want)
			}
		})
	}
}

// Set changes the autogroup of a session leader, and leaves that of a session the process does not lead
// (a login shell's) alone; a Raiser in a leader raises it and puts it back.
func TestSetAndRaiseInASessionOfItsOwn(t *testing.T) {
	if os.Getenv("FTKIT_TEST_AUTOGROUP_CHILD") == "1" {
		// The child, in a session of its own: what an agent started by systemd or the lab is.
		err := Set(-5)
		n1, _ := Get()
		release := NewRaiser(-8, slog.New(slog.DiscardHandler)).Hold()
		n2, _ := Get()
		release()
		n3, _ := Get()
		fmt.Printf("err=%v nice=%d,%d,%d\n", err, n1, n2, n3)
		return
	}
	before, err := Get()
	if errors.Is(err, ErrNone) {
		t.Skip("SKIP: this kernel has no autogroup: the threads' nice values are all there is to set")
	}
	if err != nil {
		t.Fatal(err)
	}
	if err := Set(-5); err == nil || !strings.Contains(err.Error(), "not the leader of its session") {
		t.Errorf("the test, which does not lead its session: %v, want refused", err)
	}
	if after, _ := Get(); after != before {
		t.Errorf("the session's autogroup changed from %d to %d", before, after)
	}

	cmd := exec.Command(os.Args[0], "-test.run=^TestSetAndRaiseInASessionOfItsOwn$", "-test.count=1")
	cmd.Env = append(os.Environ(), "FTKIT_TEST_AUTOGROUP_CHILD=1")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), "err=<nil> nice=-5,-8,-5") {
		t.Errorf("a session leader's autogroup after Set(-5), while raised to -8, and after:\n%s\nwant err=<nil> nice=-5,-8,-5", out)
	}
}
