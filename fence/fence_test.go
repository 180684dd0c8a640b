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
	long := strings.Repeat("x", 4*maxOutput)
	for _, tc := range []struct {
		name     string
		body     string
		timeout  time.Duration
		off      bool
		output   string // expected (prefix of) output
		errWants string
	}{
		{"off", `echo "powered off $1 at $2"`, 10 * time.Second, true, "powered off n2 at 10.0.0.2:7420", ""},
		{"refuses", `echo "BMC unreachable" >&2; exit 3`, 10 * time.Second, false, "BMC unreachable", "exit status 3"},
		{"hangs", `echo started; exec sleep 60`, 300 * time.Millisecond, false, "started", "timed out"},
		{"floods", `printf '` + long + `'`, 10 * time.Second, true, long[:maxOutput], ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := Command{Argv: []string{script(t, tc.body), "{host}", "{address}"}, Timeout: tc.timeout}
			r := c.Run(context.Background(), "n2", "10.0.0.2:7420")
			if r.Off != tc.off {
				t.Fatalf("Off = %v, want %v (%+v)", r.Off, tc.off, r)
			}
			if !strings.HasPrefix(r.Output, tc.output) || len(r.Output) > maxOutput {
				t.Errorf("Output = %q, want %q (at most %d bytes)", r.Output, tc.output, maxOutput)
			}
			if tc.errWants == "" && r.Err != nil || tc.errWants != "" && (r.Err == nil || !strings.Contains(r.Err.Error(), tc.errWants)) {
				t.Errorf("Err = %v, want %q", r.Err, tc.errWants)
			}
			if !strings.Contains(r.Detail(), "fence command") {
				t.Errorf("Detail = %q", r.Detail())
			}
		})
	}
	if r := (Command{}).Run(context.Background(), "n2", ""); r.Off || !errors.Is(r.Err, ErrNoCommand) {
		t.Fatalf("empty command: %+v", r)
	}
	if r := (Command{Argv: []string{"/nonexistent/fence"}, Timeout: time.Second}).Run(context.Background(), "n2", ""); r.Off || r.Err == nil {
		t.Fatalf("missing program: %+v", r)
	}
}
