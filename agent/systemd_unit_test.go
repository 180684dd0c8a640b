package agent

import (
	"bufio"
	"os"
	"strings"
	"testing"
)

// The unit must give the agent a private umask, keep KillMode=process (jobs outlive the agent), and wait for
// its READY=1 and watch it (Type=notify, WatchdogSec: cmd/ftagent notifies it).
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
		case section == "[Service]":
			k, v, _ := strings.Cut(line, "=")
			got[strings.TrimSpace(k)] = strings.TrimSpace(v)
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	for k, v := range map[string]string{"UMask": "0077", "KillMode": "process", "Type": "notify", "WatchdogSec": "60s"} {
		if got[k] != v {
			t.Errorf("[Service] %s=%q, want %q", k, got[k], v)
		}
	}
}
