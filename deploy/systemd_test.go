package deploy

import (
	"bufio"
	"bytes"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// unitService returns the [Service] settings of the shipped unit, each key's values in order.
func unitService(t *testing.T) map[string][]string {
	t.Helper()
	b, err := os.ReadFile("systemd/ftagent.service")
	if err != nil {
		t.Fatal(err)
	}
	got := map[string][]string{}
	section := ""
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		switch {
		case line == "" || strings.HasPrefix(line, "#"):
		case strings.HasPrefix(line, "["):
			section = line
		case section == "[Service]":
			k, v, _ := strings.Cut(line, "=")
			got[strings.TrimSpace(k)] = append(got[strings.TrimSpace(k)], strings.TrimSpace(v))
		}
	}
	return got
}

// TestUnitRestartsACrashedAgent: the unit restarts the agent after anything but a bad configuration or a
// missing precondition (RestartPreventExitStatus=2 4, ftagent's exit statuses for those). Go's runtime exits
// with status 2 too, after a panic, a fatal error, or a signal such as the SIGABRT systemd's watchdog sends a
// hung agent (WatchdogSignal's default): such an agent stayed down, its jobs unprotected, until an operator
// restarted it. Here a Go program run with the unit's environment hangs and is aborted, or panics; systemd's
// rule (the exit status or the signal against RestartPreventExitStatus, first) must restart it.
func TestUnitRestartsACrashedAgent(t *testing.T) {
	svc := unitService(t)
	if sig := svc["WatchdogSignal"]; len(sig) > 0 && sig[len(sig)-1] != "SIGABRT" {
		t.Fatalf("the test assumes the watchdog's default signal, SIGABRT; the unit sets %v", sig)
	}
	prevent := map[string]bool{}
	for _, v := range svc["RestartPreventExitStatus"] {
		for _, f := range strings.Fields(v) {
			prevent[f] = true
		}
	}
	env := []string{}
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "GOTRACEBACK=") {
			env = append(env, kv)
		}
	}
	for _, v := range svc["Environment"] {
		env = append(env, strings.Fields(v)...)
	}
	for _, mode := range []string{"hang", "panic"} {
		t.Run(mode, func(t *testing.T) {
			cmd := exec.Command(os.Args[0])
			cmd.Env = append(env, "FTKIT_DEPLOY_CRASH="+mode)
			var out bytes.Buffer
			cmd.Stderr = &out
			stdout, err := cmd.StdoutPipe()
			if err != nil {
				t.Fatal(err)
			}
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			defer cmd.Process.Kill()
			ready := make([]byte, 6)
			if _, err := io.ReadFull(stdout, ready); err != nil || string(ready) != "ready\n" {
				t.Fatalf("helper not ready: %q %v\n%s", ready, err, out.String())
			}
			if mode == "hang" {
				cmd.Process.Signal(syscall.SIGABRT)
			}
			done := make(chan error, 1)
			go func() { done <- cmd.Wait() }()
			select {
			case <-done:
			case <-time.After(time.Minute):
				t.Fatal("helper did not end")
			}
			ws := cmd.ProcessState.Sys().(syscall.WaitStatus)
			switch {
			case ws.Exited() && prevent[strconv.Itoa(ws.ExitStatus())]:
				t.Errorf("a Go agent that %ss exits with status %d, which RestartPreventExitStatus=%v lists: systemd would not restart it",
					mode, ws.ExitStatus(), svc["RestartPreventExitStatus"])
			case ws.Signaled() && prevent[unix.SignalName(ws.Signal())]:
				t.Errorf("a Go agent that %ss dies of %s, which RestartPreventExitStatus lists: systemd would not restart it", mode, ws.Signal())
			case !ws.Exited() && !ws.Signaled():
				t.Errorf("helper ended with wait status %#x", ws)
			}
		})
	}
}

// TestMain runs the Go program of TestUnitRestartsACrashedAgent when it is asked to (FTKIT_DEPLOY_CRASH), the
// tests otherwise.
func TestMain(m *testing.M) {
	if mode := os.Getenv("FTKIT_DEPLOY_CRASH"); mode != "" {
		crashingAgent(mode)
	}
	os.Exit(m.Run())
}

// crashingAgent is the Go program of TestUnitRestartsACrashedAgent: it says it is ready, then panics or hangs.
func crashingAgent(mode string) {
	// No core file, whatever the unit's environment makes of the crash.
	unix.Setrlimit(unix.RLIMIT_CORE, &unix.Rlimit{})
	os.Stdout.WriteString("ready\n")
	if mode == "panic" {
		panic("agent bug")
	}
	time.Sleep(time.Hour)
}
