package fence

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestDecide(t *testing.T) {
	t0 := time.Date(2026, 11, 23, 12, 0, 0, 0, time.UTC)
	at := func(s float64) time.Time { return t0.Add(time.Duration(s * float64(time.Second))) }
	const timeout = 5 * time.Second
	for _, tc := range []struct {
		name    string
		now     time.Time
		c       Contact
		fence   bool
		silence time.Duration
	}{
		{"both recent", at(10), Contact{Protector: at(9), Predecessor: at(9.5)}, false, 500 * time.Millisecond},
		{"protector lost, predecessor heard", at(10), Contact{Protector: at(1), Predecessor: at(9)}, false, time.Second},
		{"predecessor lost, protector answers", at(10), Contact{Protector: at(9), Predecessor: at(1)}, false, time.Second},
		{"both lost just under timeout", at(10), Contact{Protector: at(5.1), Predecessor: at(4)}, false, 4900 * time.Millisecond},
		{"both lost for exactly timeout", at(10), Contact{Protector: at(5), Predecessor: at(3)}, true, timeout},
		{"both lost long ago", at(30), Contact{Protector: at(5), Predecessor: at(6)}, true, 24 * time.Second},
		{"never heard, watching just started", at(3), Contact{}, false, 3 * time.Second},
		{"never heard for timeout", at(6), Contact{}, true, 6 * time.Second},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := Decide(tc.now, t0, tc.c, timeout)
			if d.Fence != tc.fence || d.Silence != tc.silence {
				t.Fatalf("Decide = %+v, want fence=%v silence=%s", d, tc.fence, tc.silence)
			}
		})
	}
}

// TestProtectorWaitsLongerThanVictim checks the rule both sides rely on: whenever the victim's last
// answered probe is at most one interval after the protector's last beat arrived, the victim has fenced
// (decided and killed) before ReadyAt, even with its clock ticking 0.5% slower.
func TestProtectorWaitsLongerThanVictim(t *testing.T) {
	for _, tm := range []Timing{
		{Interval: 200 * time.Millisecond, Timeout: 3 * time.Second},
		{Interval: 500 * time.Millisecond, Timeout: 7 * time.Second},
		{Interval: 2 * time.Second, Timeout: 60 * time.Second},
	} {
		lastBeat := time.Date(2026, 11, 23, 12, 0, 0, 0, time.UTC)
		lastProbe := lastBeat.Add(tm.Interval)
		// The victim checks every Check: the first check at or after lastProbe+Timeout fences.
		decided := lastProbe.Add(tm.Timeout + tm.Check())
		if !Decide(decided, lastBeat, Contact{Protector: lastProbe, Predecessor: lastBeat}, tm.Timeout).Fence {
			t.Fatalf("%+v: victim has not fenced at %s", tm, decided.Sub(lastBeat))
		}
		killed := decided.Add(KillBound)
		slow := lastBeat.Add(time.Duration(float64(killed.Sub(lastBeat)) * 1.005))
		if ready := tm.ReadyAt(lastBeat); !ready.After(slow) {
			t.Fatalf("%+v: protector ready %s after the last beat, victim done only by %s", tm, ready.Sub(lastBeat), slow.Sub(lastBeat))
		}
	}
}

// TestVouchBy: a node that stalled asks for a vouch until the kill must begin, and whenever that is not
// past, its kill (KillBound/2 of the bound left) still ends before the protector's ReadyAt, with its clock
// ticking 0.5% slower; a node that woke up later asks for Check.
func TestVouchBy(t *testing.T) {
	tm := Timing{Interval: 200 * time.Millisecond, Timeout: 3 * time.Second}
	lastBeat := time.Date(2026, 11, 23, 12, 0, 0, 0, time.UTC)
	ms := func(n int) time.Time { return lastBeat.Add(time.Duration(n) * time.Millisecond) }
	for _, tc := range []struct {
		name                  string
		now, since, protector time.Time
		want                  time.Time
	}{
		// Contact one interval after the last beat arrived (the next beat, received in part): the latest the
		// protector's wait allows for.
		{"woke just past the timeout", ms(3210), ms(-5000), ms(200), ms(200 + 3000 + 100 + 500)},
		{"woke on the check grid", ms(3300), ms(-5000), ms(200), ms(3800)},
		{"no contact since watching began", ms(3100), ms(0), time.Time{}, ms(3600)},
		{"watching began after the contact", ms(3500), ms(100), ms(50), ms(3700)},
		{"woke within Check of the deadline", ms(3750), ms(0), ms(200), ms(3850)},
		{"woke long after", ms(9000), ms(0), ms(200), ms(9100)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := tm.VouchBy(tc.now, tc.since, tc.protector)
			if !got.Equal(tc.want) {
				t.Fatalf("VouchBy = %s after the last beat, want %s", got.Sub(lastBeat), tc.want.Sub(lastBeat))
			}
			if got.Sub(tc.now) > tm.Check() {
				killed := got.Add(KillBound / 2)
				slow := lastBeat.Add(time.Duration(float64(killed.Sub(lastBeat)) * 1.005))
				if ready := tm.ReadyAt(lastBeat); !ready.After(slow) {
					t.Fatalf("protector ready %s after the last beat, vouch asked and kill done only by %s", ready.Sub(lastBeat), slow.Sub(lastBeat))
				}
			}
		})
	}
}

// A node asks the members early enough that an answer bounded by the probe timeout is in when its
// protector's silence reaches the fence timeout; never before the silence began.
func TestAskMembersAfter(t *testing.T) {
	for _, tt := range []struct {
		timing Timing
		probe  time.Duration
		want   time.Duration
	}{
		{Timing{Interval: 500 * time.Millisecond, Timeout: 7 * time.Second}, 3 * time.Second, 3500 * time.Millisecond}, // the defaults
		{Timing{Interval: 20 * time.Millisecond, Timeout: 300 * time.Millisecond}, 200 * time.Millisecond, 80 * time.Millisecond},
		{Timing{Interval: time.Second, Timeout: 2 * time.Second}, 3 * time.Second, 0},
	} {
		got := tt.timing.AskMembersAfter(tt.probe)
		if got != tt.want {
			t.Errorf("%+v, probe %s: %s, want %s", tt.timing, tt.probe, got, tt.want)
		}
		if got > 0 && got+tt.probe+tt.timing.Check() > tt.timing.Timeout {
			t.Errorf("%+v, probe %s: asked at %s, the answer may come after the timeout", tt.timing, tt.probe, got)
		}
	}
}

func TestValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		tm   Timing
		hb   time.Duration
		ok   bool
	}{
		{"default", Timing{Interval: 500 * time.Millisecond, Timeout: 7 * time.Second}, 3 * time.Second, true},
		{"exactly twice", Timing{Interval: 500 * time.Millisecond, Timeout: 6 * time.Second}, 3 * time.Second, true},
		{"below twice the heartbeat timeout", Timing{Interval: 500 * time.Millisecond, Timeout: 5 * time.Second}, 3 * time.Second, false},
		{"no interval", Timing{Timeout: 7 * time.Second}, 3 * time.Second, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.tm.Validate(tc.hb); (err == nil) != tc.ok {
				t.Fatalf("Validate = %v, want ok=%v", err, tc.ok)
			}
		})
	}
}

func TestExpandAndCheckArgv(t *testing.T) {
	got := Expand([]string{"/usr/local/sbin/fence-ipmi", "{host}", "--addr={address}", "{host} x"}, "n2", "10.0.0.2")
	want := []string{"/usr/local/sbin/fence-ipmi", "n2", "--addr=10.0.0.2", "n2 x"}
	if !slices.Equal(got, want) {
		t.Fatalf("Expand = %q, want %q", got, want)
	}
	for _, tc := range []struct {
		argv []string
		ok   bool
	}{
		{nil, true},
		{[]string{"/usr/local/sbin/fence-ipmi", "{host}", "{address}"}, true},
		{[]string{"fence-ipmi", "{host}"}, false},
		{[]string{"/bin/fence", "{hostname}"}, false},
		{[]string{"/bin/fence", "{host"}, false},
	} {
		if err := CheckArgv(tc.argv); (err == nil) != tc.ok {
			t.Errorf("CheckArgv(%q) = %v, want ok=%v", tc.argv, err, tc.ok)
		}
	}
}

// script writes an executable shell script and returns its path.
func script(t *testing.T, body string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "fence.sh")
	if err := os.WriteFile(p, []byte("#!/bin/sh\n"+body+"\n"), 0o700); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestCommandRun(t *testing.T) {
	t.Setenv("FENCE_TEST_SECRET", "hunter2")
	t.Setenv("PATH", "/usr/sbin:/usr/bin:/sbin:/bin") // root's directories: the command gets them all
	long := strings.Repeat("x", 2*maxOutput) + "the end"
	for _, tc := range []struct {
		name     string
		body     string
		timeout  time.Duration
		off      bool
		output   string // the output contains it
		errWants string
	}{
		{"off", `echo "powered off $1 at $2"`, 10 * time.Second, true, "powered off n2 at 10.0.0.2:7420", ""},
		{"refuses", `echo "BMC unreachable" >&2; exit 3`, 10 * time.Second, false, "BMC unreachable", "exit status 3"},
		{"hangs", `echo started; exec sleep 60`, 300 * time.Millisecond, false, "started", "timed out"},
		// The end of a long output is kept: it is where a failing tool says why.
		{"floods", `printf '` + long + `'`, 10 * time.Second, true, long[len(long)-maxOutput:], ""},
		// Nothing of the agent's environment but PATH, no terminal or socket on stdin, and / as the
		// working directory (not wherever the agent was started).
		{"clean environment", `echo "secret=${FENCE_TEST_SECRET-unset} path=$PATH pwd=$(pwd)"; read line && echo "stdin=$line"; true`,
			10 * time.Second, true, "secret=unset path=/usr/sbin:/usr/bin:/sbin:/bin pwd=/", ""},
		{"host name is not shell syntax", `echo "arg=$1"`, 10 * time.Second, true, "arg=n2", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := Command{Argv: []string{script(t, tc.body), "{host}", "{address}"}, Timeout: tc.timeout}
			r := c.Run(context.Background(), "n2", "10.0.0.2:7420")
			if r.Off != tc.off {
				t.Fatalf("Off = %v, want %v (%+v)", r.Off, tc.off, r)
			}
			if !strings.Contains(r.Output, tc.output) || len(r.Output) > maxOutput {
				t.Errorf("Output = %q, want it to contain %q (at most %d bytes)", r.Output, tc.output, maxOutput)
			}
			if strings.Contains(r.Output, "stdin=") {
				t.Errorf("the command read a line from its standard input: %q", r.Output)
			}
			if tc.errWants == "" && r.Err != nil || tc.errWants != "" && (r.Err == nil || !strings.Contains(r.Err.Error(), tc.errWants)) {
				t.Errorf("Err = %v, want %q", r.Err, tc.errWants)
			}
			if !strings.Contains(r.Detail(), "fence command") || len(r.Detail()) > maxDetailOutput+200 {
				t.Errorf("Detail = %q (%d bytes)", r.Detail(), len(r.Detail()))
			}
		})
	}
	if r := (Command{}).Run(context.Background(), "n2", ""); r.Off || !errors.Is(r.Err, ErrNoCommand) {
		t.Fatalf("empty command: %+v", r)
	}
	if r := (Command{Argv: []string{"/nonexistent/fence"}, Timeout: time.Second}).Run(context.Background(), "n2", ""); r.Off || r.Err == nil {
		t.Fatalf("missing program: %+v", r)
	}
	// A host name with shell syntax in it stays one argument.
	c := Command{Argv: []string{script(t, `echo "arg=$1 n=$#"`), "{host}"}, Timeout: 10 * time.Second}
	if r := c.Run(context.Background(), "n2; echo pwned", ""); !r.Off || !strings.Contains(r.Output, "arg=n2; echo pwned n=1") {
		t.Errorf("host with shell syntax: %+v", r)
	}
	// A program others may change is not run.
	p := script(t, `echo ran`)
	if err := os.Chmod(p, 0o777); err != nil {
		t.Fatal(err)
	}
	if r := (Command{Argv: []string{p}, Timeout: 10 * time.Second}).Run(context.Background(), "n2", ""); r.Off || r.Output != "" ||
		r.Err == nil || !strings.Contains(r.Err.Error(), "not run") {
		t.Errorf("world-writable program: %+v", r)
	}
}

// TestCommandTimeoutKillsGroup: on timeout the command's children die with it (a script's ipmitool must
// not keep powering things on and off after the agent gave up on it).
func TestCommandTimeoutKillsGroup(t *testing.T) {
	pidFile := filepath.Join(t.TempDir(), "child")
	c := Command{Argv: []string{script(t, `sleep 60 & echo $! > `+pidFile+`; wait`)}, Timeout: 500 * time.Millisecond}
	r := c.Run(context.Background(), "n2", "")
	if r.Off || r.Err == nil || !strings.Contains(r.Err.Error(), "timed out") {
		t.Fatalf("Run = %+v, want a timeout", r)
	}
	b, err := os.ReadFile(pidFile)
	if err != nil {
		t.Fatalf("the script did not record its child: %v", err)
	}
	stat := filepath.Join("/proc", strings.TrimSpace(string(b)), "stat")
	deadline := time.Now().Add(30 * time.Second)
	for {
		s, err := os.ReadFile(stat)
		// Gone, or a zombie waiting for its new parent to reap it.
		if err != nil || strings.Contains(string(s), ") Z ") {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the command's child still runs after the timeout: %s", s)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestResultDetail(t *testing.T) {
	long := strings.Repeat("noise ", 500) + "chassis power is off"
	for _, tc := range []struct {
		name  string
		r     Result
		wants []string
	}{
		{"off", Result{Off: true, Took: 1234 * time.Millisecond, Output: "Chassis Power Control: Down/Off\nChassis Power is off\n"},
			[]string{"confirmed the host is off in 1.234s: Chassis Power Control: Down/Off Chassis Power is off"}},
		{"failed", Result{Took: time.Second, Err: errors.New("exit status 1"), Output: "Unable to establish IPMI v2 / RMCP+ session"},
			[]string{"fence command failed (exit status 1) after 1s: Unable to establish"}},
		{"long output keeps its end", Result{Off: true, Output: long}, []string{"...", "chassis power is off"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := tc.r.Detail()
			for _, w := range tc.wants {
				if !strings.Contains(d, w) {
					t.Errorf("Detail = %q, want %q in it", d, w)
				}
			}
			if len(d) > maxDetailOutput+200 || strings.Contains(d, "\n") {
				t.Errorf("Detail is %d bytes or has a newline: %q", len(d), d)
			}
		})
	}
}

func TestCheckProgram(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("SKIP: needs root: the cases give files to root and to others")
	}
	type setup func(t *testing.T, dir string) string // returns the program's path
	file := func(mode os.FileMode, uid int) setup {
		return func(t *testing.T, dir string) string {
			p := filepath.Join(dir, "fence")
			if err := os.WriteFile(p, []byte("#!/bin/sh\n"), 0o600); err != nil {
				t.Fatal(err)
			}
			if err := os.Chmod(p, mode); err != nil {
				t.Fatal(err)
			}
			if err := os.Chown(p, uid, uid); err != nil {
				t.Fatal(err)
			}
			return p
		}
	}
	inDir := func(mode os.FileMode, uid int, then setup) setup {
		return func(t *testing.T, dir string) string {
			d := filepath.Join(dir, "sub")
			if err := os.Mkdir(d, 0o700); err != nil {
				t.Fatal(err)
			}
			if err := os.Chmod(d, mode); err != nil {
				t.Fatal(err)
			}
			if err := os.Chown(d, uid, uid); err != nil {
				t.Fatal(err)
			}
			return then(t, d)
		}
	}
	linkIn := func(linkDir setup) setup {
		return func(t *testing.T, dir string) string {
			target := file(0o755, 0)(t, dir)
			l := filepath.Join(filepath.Dir(linkDir(t, dir)), "link")
			if err := os.Symlink(target, l); err != nil {
				t.Fatal(err)
			}
			return l
		}
	}
	for _, tc := range []struct {
		name  string
		setup setup
		err   string // "" ok
	}{
		{"root's 0755", file(0o755, 0), ""},
		{"root's 0700", file(0o700, 0), ""},
		{"group-writable", file(0o775, 0), "mode 0775"},
		{"world-writable", file(0o757, 0), "mode 0757"},
		{"a user's", file(0o755, 1000), "owned by uid 1000"},
		{"not executable", file(0o644, 0), "not executable"},
		{"in a world-writable directory", inDir(0o777, 0, file(0o755, 0)), "mode 0777"},
		{"in a sticky root directory (like /tmp)", inDir(os.ModeSticky|0o777, 0, file(0o755, 0)), ""},
		{"in a user's sticky directory", inDir(os.ModeSticky|0o777, 1000, file(0o755, 0)), "owned by uid 1000"},
		{"in a user's directory", inDir(0o755, 1000, file(0o755, 0)), "owned by uid 1000"},
		{"link to a safe program", linkIn(inDir(0o755, 0, file(0o755, 0))), ""},
		{"link in a user's directory", linkIn(inDir(0o755, 1000, file(0o755, 0))), "owned by uid 1000"},
		{"a directory", func(t *testing.T, dir string) string { return dir }, "not a regular file"},
		{"missing", func(t *testing.T, dir string) string { return filepath.Join(dir, "none") }, "no such file"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := CheckProgram(tc.setup(t, t.TempDir()))
			if tc.err == "" && err != nil || tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)) {
				t.Fatalf("CheckProgram = %v, want %q", err, tc.err)
			}
		})
	}
}
