package autogroup

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
)

// current reads this process's autogroup nice value.
func current() (nice int, own bool, err error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, false, err
	}
	return parse(b)
}

// parse reads the kernel's "/autogroup-<id> nice <n>\n". A process in the kernel's default group, the one
// of pid 1's session, which no one can reweigh, reads as nothing: own is false. CI harnesses run there.
func parse(b []byte) (nice int, own bool, err error) {
	if len(b) == 0 {
		return 0, false, nil
	}
	f := strings.Fields(string(b))
	if len(f) != 3 || !strings.HasPrefix(f[0], "/autogroup-") || f[1] != "nice" {
		return 0, false, fmt.Errorf("%s: unexpected %q", path, b)
	}
	nice, err = strconv.Atoi(f[2])
	return nice, err == nil, err
}

func TestParse(t *testing.T) {
	for _, c := range []struct {
		in      string
		nice    int
		own, ok bool
	}{
		{"/autogroup-16288 nice 0\n", 0, true, true},
		{"/autogroup-7 nice -5\n", -5, true, true},
		{"", 0, false, true}, // pid 1's session: the kernel's default group (ci on the old reader: "unexpected")
		{"/autogroup-7 nice\n", 0, false, false},
		{"/autogroup-7 nice x\n", 0, false, false},
		{"/cgroup-7 nice 0\n", 0, false, false},
	} {
		nice, own, err := parse([]byte(c.in))
		if (err == nil) != c.ok || nice != c.nice || own != c.own {
			t.Errorf("parse(%q) = %d, %v, %v; want %d, %v, ok %v", c.in, nice, own, err, c.nice, c.own, c.ok)
		}
	}
}

// fakeGroup is an autogroup whose changes a test reads back.
type fakeGroup struct {
	nice   int
	setErr error
	sets   []int
}

func (g *fakeGroup) raiser(nice, base int) *Raiser {
	r := NewRaiser(nice, base, slog.New(slog.DiscardHandler))
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
		base     int
		sets     []int // every value set, in order, over two overlapping holds
		duringAt int   // the group's value while both are held
	}{
		{"raised once for overlapping holds, put back after the last", fakeGroup{nice: 0}, -10, 0, []int{-10, 0}, -10},
		{"heartbeat.nice's group gets its value back after", fakeGroup{nice: -5}, -10, -5, []int{-10, -5}, -10},
		{"a group already higher is left alone", fakeGroup{nice: -15}, -10, -15, nil, -15},
		{"a group at the value is left alone", fakeGroup{nice: -10}, -10, -10, nil, -10},
		{"a refused change changes nothing", fakeGroup{nice: 0, setErr: errors.New("EPERM")}, -10, 0, nil, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			g := c.g
			r := g.raiser(c.raise, c.base)
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

// A dump that begins before the agent gave its group heartbeat.nice (both start with the agent) ends with
// the group at heartbeat.nice, not at the value found before the dump.
func TestRaiserKeepsAValueSetWhileHeld(t *testing.T) {
	g := fakeGroup{nice: 0}
	release := g.raiser(-10, -5).Hold()
	g.nice = -5 // heartbeat.nice applied meanwhile (autogroup.Set)
	release()
	if g.nice != -5 {
		t.Errorf("after the hold: nice %d, want heartbeat.nice's -5", g.nice)
	}
}

// Set changes the autogroup of a session leader, and leaves that of a session the process does not lead
// (a login shell's) alone; a Raiser in a leader raises it and puts it back.
func TestSetAndRaiseInASessionOfItsOwn(t *testing.T) {
	if base := os.Getenv("FTKIT_TEST_AUTOGROUP_CHILD"); base != "" {
		// The child, in a session of its own: what an agent started by systemd or the lab is.
		n, _ := strconv.Atoi(base)
		err := Set(n)
		n1, _, _ := current()
		release := NewRaiser(-8, n, slog.New(slog.DiscardHandler)).Hold()
		n2, _, _ := current()
		release()
		n3, _, _ := current()
		fmt.Printf("err=%v nice=%d,%d,%d\n", err, n1, n2, n3)
		return
	}
	if _, err := os.Stat(path); errors.Is(err, os.ErrNotExist) {
		t.Skip("SKIP: this kernel has no autogroup: the threads' nice values are all there is to set")
	}
	before, own, err := current()
	if err != nil {
		t.Fatal(err)
	}
	if !own {
		t.Logf("the test runs in the kernel's default group (pid 1's session), which has no nice value of its own")
	}
	if err := Set(-5); err == nil || !strings.Contains(err.Error(), "not the leader of its session") {
		t.Errorf("the test, which does not lead its session: %v, want refused", err)
	}
	if after, ownAfter, _ := current(); after != before || ownAfter != own {
		t.Errorf("the session's autogroup changed from %d (own %v) to %d (own %v)", before, own, after, ownAfter)
	}

	// heartbeat.nice's two directions: the agent before the jobs, and after them.
	for _, base := range []int{-5, 19} {
		cmd := exec.Command(os.Args[0], "-test.run=^TestSetAndRaiseInASessionOfItsOwn$", "-test.count=1")
		cmd.Env = append(os.Environ(), fmt.Sprintf("FTKIT_TEST_AUTOGROUP_CHILD=%d", base))
		cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("child: %v\n%s", err, out)
		}
		if want := fmt.Sprintf("err=<nil> nice=%d,-8,%d", base, base); !strings.Contains(string(out), want) {
			t.Errorf("a session leader's autogroup after Set(%d), while raised to -8, and after:\n%s\nwant %s", base, out, want)
		}
	}
}
