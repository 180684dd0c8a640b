package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/internal/cli"
	"github.com/ftkit/ftkit/lab/labcluster"
	"github.com/ftkit/ftkit/lab/labtest"
)

// TestClusterOperatorEndToEnd: from a lab host's namespace (no agent socket of the hosts asked is reachable
// from there, only their cluster addresses), `ftctl --cluster` with an operator certificate of the lab's
// CA lists the jobs of every host and takes a snapshot on node2; the agent logs the operator's request. An
// operator certificate of another CA and a member's certificate used as an operator's are refused.
func TestClusterOperatorEndToEnd(t *testing.T) {
	labtest.RequireRoot(t)
	ftctl := buildFtctl(t)
	bin := t.TempDir()
	if out, err := exec.Command("go", "build", "-o", bin+"/", "github.com/ftkit/ftkit/cmd/ftagent").CombinedOutput(); err != nil {
		t.Fatalf("go build ftagent: %v\n%s", err, out)
	}
	l := labtest.New(t, 2, 1)
	id := l.State().ID
	c, err := labcluster.Start(context.Background(), l, labcluster.Options{AgentBin: filepath.Join(bin, "ftagent"), Interval: "1h"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			for _, h := range l.State().Hosts {
				if b, err := os.ReadFile(c.LogPath(h.Name)); err == nil {
					t.Logf("agent log of %s:\n%s", h.Name, b)
				}
			}
		}
	})
	jobs := map[string]string{}
	for _, host := range []string{"node1", "node2"} {
		j, err := c.Client(host).StartJob(context.Background(), agent.JobSpec{Name: "count-" + host,
			Argv: []string{"/bin/sh", "-c", "i=0; while true; do echo $i; i=$((i+1)); sleep 0.1; done"}, Env: []string{"PATH=/usr/bin:/bin"}})
		if err != nil {
			t.Fatal(err)
		}
		jobs[host] = j.ID
	}

	// The operator's credentials from the lab's CA, and one configuration per certificate tried.
	work := t.TempDir()
	run := func(args ...string) (string, error) {
		cmd := exec.Command(ftctl, args...)
		out, err := cmd.Output()
		if ee := (*exec.ExitError)(nil); errors.As(err, &ee) {
			err = fmt.Errorf("%w: %s", err, ee.Stderr)
		}
		return string(out), err
	}
	if out, err := run("pki", "issue", "--dir", labcluster.PKIDir(id), "--operator", "alice", "--validity", "1d", "--out", filepath.Join(work, "alice")); err != nil {
		t.Fatalf("pki issue --operator: %v\n%s", err, out)
	}
	seed := l.State().Hosts[0]
	config := func(name, ca, cert, key string) string {
		p := filepath.Join(work, name+".toml")
		body := fmt.Sprintf("ca = %q\ncert = %q\nkey = %q\ntimeout = \"30s\"\n[[agent]]\nname = %q\naddress = \"%s:%d\"\n",
			ca, cert, key, seed.Name, seed.Addr.Addr(), labcluster.AgentPort)
		if err := os.WriteFile(p, []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	alice := config("alice", filepath.Join(work, "alice", caCertName), filepath.Join(work, "alice", "operator-alice.crt"), filepath.Join(work, "alice", "operator-alice.key"))
	// From spare1's namespace: the agents are reached at their cluster addresses only.
	fromSpare := func(args ...string) (string, int, error) {
		cmd := exec.Command(ftctl, append([]string{"lab", "--lab", id, "exec", "spare1", "--", ftctl}, args...)...)
		out, err := cmd.Output()
		code := 0
		if ee := (*exec.ExitError)(nil); errors.As(err, &ee) {
			code, err = ee.ExitCode(), fmt.Errorf("%w: %s", err, ee.Stderr)
		}
		return string(out), code, err
	}

	// status: every host's jobs. A job shows once its agent has recorded it; they were started above.
	out, code, err := fromSpare("--cluster", alice, "status", "--json")
	if code != 0 {
		t.Fatalf("status --json: exit %d, %v\n%s", code, err, out)
	}
	var hosts []struct {
		Node  string      `json:"node"`
		Jobs  []agent.Job `json:"jobs"`
		Error string      `json:"error"`
	}
	if err := json.Unmarshal([]byte(out), &hosts); err != nil {
		t.Fatalf("status --json: %v\n%s", err, out)
	}
	seen := map[string]string{}
	for _, h := range hosts {
		if h.Error != "" {
			t.Errorf("host %s: %s", h.Node, h.Error)
		}
		for _, j := range h.Jobs {
			seen[j.ID] = h.Node
		}
	}
	if len(hosts) != 3 || seen[jobs["node1"]] != "node1" || seen[jobs["node2"]] != "node2" {
		t.Fatalf("status lists hosts %+v; want node1, node2 and spare1, each job on its host (%v)", hosts, jobs)
	}

	// checkpoint --host node2: a snapshot of node2's job, taken there and replicated.
	out, code, err = fromSpare("--cluster", alice, "checkpoint", "--host", "node2", "--json")
	if code != 0 {
		t.Fatalf("checkpoint --host node2: exit %d, %v\n%s", code, err, out)
	}
	var results []agent.SnapshotResult
	if err := json.Unmarshal([]byte(out), &results); err != nil {
		t.Fatalf("checkpoint --json: %v\n%s", err, out)
	}
	if len(results) != 1 || results[0].Manifest.Job != jobs["node2"] || results[0].Manifest.Node != "node2" || !results[0].Shipped {
		t.Fatalf("checkpoint --host node2 took %+v; want one replicated snapshot of %s on node2", results, jobs["node2"])
	}
	// The agent's own first snapshot of the job ("no replica yet") may follow the operator's: the list must
	// hold the operator's, not necessarily first (ci60 had both, the agent's newest).
	ms, err := c.Client("node2").Snapshots(context.Background(), jobs["node2"])
	if err != nil || !slices.ContainsFunc(ms, func(m *ckpt.Manifest) bool { return m.ID == results[0].Manifest.ID }) {
		ids := make([]string, 0, len(ms))
		for _, m := range ms {
			ids = append(ids, m.ID)
		}
		t.Errorf("node2's own list of %s's snapshots: %v, %v; want it to hold %s", jobs["node2"], ids, err, results[0].Manifest.ID)
	}
	// The audit line, on the agent that did the work.
	log, err := os.ReadFile(c.LogPath("node2"))
	if err != nil || !strings.Contains(string(log), "operator request") || !strings.Contains(string(log), "operator=alice op=operator/checkpoint") {
		t.Errorf("node2's log has no audit line of alice's checkpoint (%v)", err)
	}

	// restore goes to the host named, which refuses: the job still runs on node2 (no --force).
	out, code, err = fromSpare("--cluster", alice, "restore", "--host", "spare1", "--snapshot", results[0].Manifest.ID)
	if code != cli.ExitFailure || !strings.Contains(fmt.Sprint(err), "still running") {
		t.Errorf("restore on spare1 of a job that runs: exit %d, %v\n%s; want exit 1, refused as still running", code, err, out)
	}
	if log, err := os.ReadFile(c.LogPath("spare1")); err != nil || !strings.Contains(string(log), "operator=alice op=operator/restore") {
		t.Errorf("spare1's log has no audit line of alice's restore (%v)", err)
	}

	// An operator certificate of another CA: refused by the agent's handshake.
	if out, err := run("pki", "init", "--dir", filepath.Join(work, "other")); err != nil {
		t.Fatalf("pki init: %v\n%s", err, out)
	}
	if out, err := run("pki", "issue", "--dir", filepath.Join(work, "other"), "--operator", "mallory", "--out", filepath.Join(work, "mallory")); err != nil {
		t.Fatalf("pki issue: %v\n%s", err, out)
	}
	mallory := config("mallory", filepath.Join(work, "alice", caCertName), filepath.Join(work, "mallory", "operator-mallory.crt"), filepath.Join(work, "mallory", "operator-mallory.key"))
	if out, code, err := fromSpare("--cluster", mallory, "status", "--json"); code != cli.ExitFailure || !strings.Contains(fmt.Sprint(err), "certificate") {
		t.Errorf("status with another CA's operator certificate: exit %d, %v\n%s; want exit 1, a certificate refusal", code, err, out)
	}
	// A member's certificate (spare1's own, on spare1) used as an operator's: refused for every operator
	// operation.
	pki := labcluster.PKIDir(id)
	member := config("member", filepath.Join(pki, caCertName), filepath.Join(pki, "spare1.crt"), filepath.Join(pki, "spare1.key"))
	for _, args := range [][]string{{"status", "--json"}, {"checkpoint", "--host", "node1"}} {
		out, code, err := fromSpare(append([]string{"--cluster", member}, args...)...)
		if code != cli.ExitFailure || !strings.Contains(fmt.Sprint(err), "member certificate may not call operator operations") {
			t.Errorf("%s with a member certificate: exit %d, %v\n%s; want exit 1, refused as no operator", args[0], code, err, out)
		}
	}
	if n1, err := os.ReadFile(c.LogPath("node1")); err != nil || strings.Contains(string(n1), "op=operator/checkpoint") {
		t.Errorf("node1 logged a checkpoint by an operator, or its log is unreadable (%v)", err)
	}
}
