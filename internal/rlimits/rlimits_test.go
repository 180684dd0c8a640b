package rlimits

import (
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

func TestValidate(t *testing.T) {
	for _, tt := range []struct {
		name string
		ls   []Limit
		want string // "" valid
	}{
		{"none", nil, ""},
		{"session", Session, ""},
		{"unlimited", []Limit{{Resource: unix.RLIMIT_CORE, Cur: unix.RLIM_INFINITY, Max: unix.RLIM_INFINITY}}, ""},
		{"negative resource", []Limit{{Resource: -1}}, "no such resource"},
		{"resource past the last", []Limit{{Resource: count}}, "no such resource"},
		{"twice", []Limit{{Resource: 7, Cur: 1, Max: 2}, {Resource: 7, Cur: 1, Max: 2}}, "given twice"},
		{"soft above hard", []Limit{{Resource: 7, Cur: 3, Max: 2}}, "above the hard limit"},
		{"too many", make([]Limit, count+1), "Linux has"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			err := Validate(tt.ls)
			if (tt.want == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), tt.want)) {
				t.Errorf("Validate = %v, want %q", err, tt.want)
			}
		})
	}
}

// A child applies what Of read of this process, and Session when given nothing; as root, as the job's
// init does before it drops its privileges.
func TestOfAndApply(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("SKIPPED: raising a hard limit needs root (as the agent runs)")
	}
	if os.Getenv("RLIMITS_TEST_CHILD") == "apply" {
		var ls []Limit
		if os.Getenv("RLIMITS_TEST_SESSION") == "" {
			ls = []Limit{{Resource: unix.RLIMIT_NOFILE, Cur: 777, Max: 888}, {Resource: unix.RLIMIT_MEMLOCK, Cur: unix.RLIM_INFINITY, Max: unix.RLIM_INFINITY}}
		}
		before, err := Of(os.Getpid())
		if err != nil {
			t.Fatal(err)
		}
		if err := Apply(ls); err != nil {
			t.Fatal(err)
		}
		got, err := Of(os.Getpid())
		if err != nil {
			t.Fatal(err)
		}
		want := map[int]Limit{}
		for _, l := range ls {
			want[l.Resource] = l
		}
		if len(ls) == 0 {
			for _, l := range Session {
				want[l.Resource] = l
			}
		}
		raise := canRaise(t)
		for r, w := range want {
			if !raise && w.Max > before[r].Max { // capped at the process's own
				w.Max = before[r].Max
				w.Cur = min(w.Cur, w.Max)
				want[r] = w
			}
		}
		for _, l := range got {
			if w, ok := want[l.Resource]; ok && l != w {
				t.Errorf("after Apply, resource %d is %d/%d, want %d/%d", l.Resource, l.Cur, l.Max, w.Cur, w.Max)
			}
		}
		return
	}
	for _, session := range []string{"", "1"} {
		cmd := exec.Command(os.Args[0], "-test.run=^TestOfAndApply$", "-test.count=1")
		cmd.Env = append(os.Environ(), "RLIMITS_TEST_CHILD=apply", "RLIMITS_TEST_SESSION="+session)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Errorf("child (session %q): %v\n%s", session, err, out)
		}
	}
	ls, err := Of(os.Getpid())
	if err != nil || len(ls) != count || Validate(ls) != nil {
		t.Errorf("Of(self) = %v, %v", ls, err)
	}
}

// canRaise reports whether this process has CAP_SYS_RESOURCE, which raising a hard limit needs.
func canRaise(t *testing.T) bool {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(line, "CapEff:"); ok {
			caps, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			if err != nil {
				t.Fatal(err)
			}
			return caps&(1<<unix.CAP_SYS_RESOURCE) != 0
		}
	}
	t.Fatal("no CapEff in /proc/self/status")
	return false
}
