package agent

import (
	"bufio"
	"os"
	"strings"
	"testing"
)

// The unit must give the agent a private umask, keep KillMode=process (jobs outlive the agent), wait for
// its READY=1 and watch it (Type=notify, WatchdogSec: cmd/ftagent notifies it), and restart it after any
// number of quick failures (a cluster address not up yet at boot) but not after a bad configuration or a
// missing precondition, which a restart does not fix.
func TestSystemdUnit(t *testing.T) {
	f, err := os.Open("../deploy/systemd/ftagent.service")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	section := ""
	got := map[string]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		switch {
		case line == "" || strings.HasPrefix(line, "#"):
		case strings.HasPrefix(line, "["):
			section = line
		default:
			k, v, _ := strings.Cut(line, "=")
			got[section+strings.TrimSpace(k)] = strings.TrimSpace(v)
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	for k, v := range map[string]string{"[Service]UMask": "0077", "[Service]KillMode": "process", "[Service]Type": "notify",
		"[Service]WatchdogSec": "60s", "[Unit]StartLimitIntervalSec": "0", "[Service]RestartPreventExitStatus": "2 4"} {
		if got[k] != v {
			t.Errorf("%s=%q, want %q", k, got[k], v)
		}
	}
}
