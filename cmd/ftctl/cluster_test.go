package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/ckpt"
	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/internal/cli"
	"github.com/ftkit/ftkit/internal/clustertls"
	"github.com/ftkit/ftkit/ring"
)

// writeClusterConfig writes an operator's files (a key of the given mode) and a configuration naming them
// relative to its directory, with body appended; it returns the configuration's path.
func writeClusterConfig(t *testing.T, ca *clustertls.CA, keyMode os.FileMode, body string) string {
	t.Helper()
	dir := t.TempDir()
	cert, key, err := ca.IssueOperator("alice", time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := clustertls.WriteFiles(filepath.Join(dir, "op"), "operator-alice", ca.CertPEM(), cert, key); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(filepath.Join(dir, "op", "operator-alice.key"), keyMode); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "ftctl.toml")
	head := "ca = \"op/cluster_ca.crt\"\ncert = \"op/operator-alice.crt\"\nkey = \"op/operator-alice.key\"\n"
	if err := os.WriteFile(path, []byte(head+body), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestLoadClusterConfig(t *testing.T) {
	ca, err := clustertls.NewCA("test", 24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	const agents = "[[agent]]\nname = \"node1\"\naddress = \"10.0.0.1:7700\"\n"
	tests := []struct {
		name    string
		keyMode os.FileMode
		body    string
		code    int
		want    string
	}{
		{"good", 0o600, agents, cli.ExitOK, ""},
		{"a timeout", 0o600, "timeout = \"3s\"\n" + agents, cli.ExitOK, ""},
		{"no agent", 0o600, "", cli.ExitUsage, "no [[agent]]"},
		{"an unknown key", 0o600, "uid = 0\n" + agents, cli.ExitUsage, "uid"},
		{"an agent named by its address", 0o600, "[[agent]]\nname = \"10.0.0.1\"\naddress = \"10.0.0.1:7700\"\n", cli.ExitUsage, "IP address"},
		{"an address without a port", 0o600, "[[agent]]\nname = \"node1\"\naddress = \"10.0.0.1\"\n", cli.ExitUsage, "HOST:PORT"},
		{"a bad timeout", 0o600, "timeout = \"soon\"\n" + agents, cli.ExitUsage, "timeout"},
		{"a key others can read", 0o640, agents, cli.ExitUnavailable, "chmod 600"},
		{"a key others can write", 0o602, agents, cli.ExitUnavailable, "chmod 600"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			path := writeClusterConfig(t, ca, tc.keyMode, tc.body)
			cfg, timeout, err := loadClusterConfig(path)
			if tc.code == cli.ExitOK {
				if err != nil {
					t.Fatal(err)
				}
				if cfg.Key != filepath.Join(filepath.Dir(path), "op", "operator-alice.key") || len(cfg.Agents) != 1 || timeout <= 0 {
					t.Errorf("config %+v, timeout %v: relative paths not resolved from the file's directory?", cfg, timeout)
				}
				return
			}
			ee, ok := err.(*cli.ExitError)
			if !ok || ee.Code != tc.code || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("err %v, want exit %d mentioning %q", err, tc.code, tc.want)
			}
		})
	}
	t.Run("a key of another user", func(t *testing.T) {
		if os.Getuid() != 0 {
			t.Skip("SKIPPED LOUDLY: giving a file to another user needs root")
		}
		path := writeClusterConfig(t, ca, 0o600, agents)
		if err := os.Chown(filepath.Join(filepath.Dir(path), "op", "operator-alice.key"), 65534, 65534); err != nil {
			t.Fatal(err)
		}
		if _, _, err := loadClusterConfig(path); err == nil || !strings.Contains(err.Error(), "is not yours") {
			t.Errorf("err %v, want a refusal of another user's key", err)
		}
	})
	t.Run("a missing key", func(t *testing.T) {
		path := writeClusterConfig(t, ca, 0o600, agents)
		os.Remove(filepath.Join(filepath.Dir(path), "op", "operator-alice.key"))
		if _, _, err := loadClusterConfig(path); err == nil || !strings.Contains(err.Error(), "operator key") {
			t.Errorf("err %v, want the missing key named", err)
		}
	})
}

// fakeAgent serves the operator operations as member name, with the given view and one running job.
type fakeAgent struct {
	name  string
	view  *[]ring.Member
	seen  chan string // the operations asked
	ckpts chan []string
}

func (f *fakeAgent) Status(context.Context, string) (clusterapi.OperatorStatusReply, error) {
	f.seen <- "status"
	b, err := json.Marshal(agent.Status{Node: f.name, Members: *f.view, Jobs: []agent.Job{{ID: "job-on-" + f.name, Node: f.name, State: agent.JobRunning}}})
	return clusterapi.OperatorStatusReply{Status: b}, err
}

func (f *fakeAgent) Snapshots(context.Context, string, clusterapi.OperatorSnapshotsRequest) (clusterapi.OperatorSnapshotsReply, error) {
	f.seen <- "snapshots"
	return clusterapi.OperatorSnapshotsReply{Snapshots: []*ckpt.Manifest{{Job: "job-on-" + f.name, Node: f.name, ID: "20260301T120304.000Z-" + f.name + "-000001"}}}, nil
}

func (f *fakeAgent) Events(context.Context, string) (clusterapi.OperatorEventsReply, error) {
	f.seen <- "events"
	// The failure log is replicated: every agent answers with the same failure.
	return clusterapi.OperatorEventsReply{Failures: json.RawMessage(`[{"id":"node9-1","node":"node9","done":true}]`)}, nil
}

func (f *fakeAgent) Checkpoint(_ context.Context, _ string, req clusterapi.OperatorCheckpointRequest) (clusterapi.OperatorCheckpointReply, error) {
	f.seen <- "checkpoint"
	f.ckpts <- req.Jobs
	b, err := json.Marshal([]agent.SnapshotResult{{Manifest: &ckpt.Manifest{Job: req.Jobs[0], Node: f.name, ID: "20260301T120304.000Z-" + f.name + "-000007", Replicas: []string{"node2"}}, Shipped: true}})
	return clusterapi.OperatorCheckpointReply{Results: b}, err
}

func (f *fakeAgent) Restore(context.Context, string, clusterapi.OperatorRestoreRequest) (clusterapi.OperatorRestoreReply, error) {
	return clusterapi.OperatorRestoreReply{}, &clusterapi.Error{Code: clusterapi.CodeNotFound, Message: "snapshot not found"}
}

func (f *fakeAgent) Migrate(context.Context, string, clusterapi.OperatorMigrateRequest) (clusterapi.OperatorMigrateReply, error) {
	return clusterapi.OperatorMigrateReply{}, &clusterapi.Error{Code: clusterapi.CodeNotFound, Message: "job not found"}
}

func (f *fakeAgent) Drain(context.Context, string, clusterapi.OperatorDrainRequest) (clusterapi.OperatorDrainReply, error) {
	return clusterapi.OperatorDrainReply{}, &clusterapi.Error{Code: clusterapi.CodeNotFound, Message: "not here"}
}

// noMembers serves no member operation (none of these tests calls one).
type noMembers struct{ clusterapi.Service }

// fakeCluster is a fakeAgent per name served over real mutual TLS (the operator service faked), all
// listed in one view.
type fakeCluster struct {
	ca      *clustertls.CA
	view    []ring.Member
	agents  map[string]*fakeAgent
	addrs   map[string]string
	servers map[string]interface{ Close() error }
}

func startFakeCluster(t *testing.T, names ...string) *fakeCluster {
	t.Helper()
	ca, err := clustertls.NewCA("test", 24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	fc := &fakeCluster{ca: ca, agents: map[string]*fakeAgent{}, addrs: map[string]string{}, servers: map[string]interface{ Close() error }{}}
	for _, name := range names {
		cert, key, err := ca.Issue(name, nil, time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		tc, err := clustertls.WriteFiles(filepath.Join(t.TempDir(), name), name, ca.CertPEM(), cert, key)
		if err != nil {
			t.Fatal(err)
		}
		tc.Members = func(string) bool { return false }
		tc.Operators = func(n string) bool { return n == "alice" }
		ln, err := clustertls.Listen("127.0.0.1:0", tc)
		if err != nil {
			t.Fatal(err)
		}
		f := &fakeAgent{name: name, view: &fc.view, seen: make(chan string, 100), ckpts: make(chan []string, 10)}
		srv := clusterapi.NewServer(t.Context(), noMembers{}, clusterapi.ServerOptions{Operators: f}).HTTPServer()
		go srv.Serve(ln)
		t.Cleanup(func() { srv.Close() })
		fc.agents[name], fc.addrs[name], fc.servers[name] = f, ln.Addr().String(), srv
		fc.view = append(fc.view, ring.Member{Name: name, Address: netip.MustParseAddrPort(ln.Addr().String()), Role: ring.RoleNode, State: ring.StateAlive})
	}
	return fc
}

// TestClusterMode runs ftctl --cluster against two agents served over real mutual TLS (the operator
// service faked): status lists both hosts' jobs from the view the seed gives, events merges the replicated
// log, checkpoint --host goes to that host only, a not-found refusal exits 3, and a member that does not
// answer is named with exit 4 while the other's results are still printed.
func TestClusterMode(t *testing.T) {
	fc := startFakeCluster(t, "node1", "node2")
	ca, agents, addrs, servers := fc.ca, fc.agents, fc.addrs, fc.servers
	// A failed member is not asked.
	fc.view = append(fc.view, ring.Member{Name: "node9", Address: netip.MustParseAddrPort("127.0.0.1:1"), Role: ring.RoleNode, State: ring.StateFailed})
	// The file names node1 only: node2 comes from the view.
	cfg := writeClusterConfig(t, ca, 0o600, fmt.Sprintf("[[agent]]\nname = \"node1\"\naddress = %q\n", addrs["node1"]))

	out, code, err := runFtctl(t, "status", "--cluster", cfg, "--json")
	if code != 0 {
		t.Fatalf("status: exit %d, %v\n%s", code, err, out)
	}
	var hosts []struct {
		Node string      `json:"node"`
		Jobs []agent.Job `json:"jobs"`
	}
	if err := json.Unmarshal([]byte(out), &hosts); err != nil {
		t.Fatalf("status --json: %v\n%s", err, out)
	}
	if len(hosts) != 2 || hosts[0].Node != "node1" || hosts[1].Node != "node2" || len(hosts[1].Jobs) != 1 || hosts[1].Jobs[0].ID != "job-on-node2" {
		t.Errorf("status of %+v, want node1 and node2 with their jobs", hosts)
	}

	out, code, err = runFtctl(t, "events", "--cluster", cfg, "--json")
	var failures []agent.Failure
	if code != 0 || json.Unmarshal([]byte(out), &failures) != nil || len(failures) != 1 || failures[0].ID != "node9-1" {
		t.Errorf("events: exit %d, %v, %s; want the one failure once", code, err, out)
	}

	t.Setenv(clusterEnv, cfg) // the environment names the file as well as the flag does
	out, code, err = runFtctl(t, "checkpoint", "--host", "node2", "--job", "job-on-node2", "--json")
	if code != 0 || !strings.Contains(out, "job-on-node2") {
		t.Errorf("checkpoint --host node2: exit %d, %v\n%s", code, err, out)
	}
	select {
	case jobs := <-agents["node2"].ckpts:
		if len(jobs) != 1 || jobs[0] != "job-on-node2" {
			t.Errorf("node2 was asked to checkpoint %v", jobs)
		}
	default:
		t.Error("node2 was not asked to checkpoint")
	}
	if len(agents["node1"].ckpts) != 0 {
		t.Error("node1 was asked to checkpoint")
	}

	if _, code, err := runFtctl(t, "restore", "--host", "node1", "--snapshot", "20260301T120304.000Z-node1-000007"); code != cli.ExitNotFound {
		t.Errorf("restore of a snapshot nobody holds: exit %d, %v; want %d", code, err, cli.ExitNotFound)
	}
	if _, code, err := runFtctl(t, "restore", "--snapshot", "20260301T120304.000Z-node1-000007"); code != cli.ExitUsage || !strings.Contains(err.Error(), "--host") {
		t.Errorf("restore without --host on two agents: exit %d, %v; want %d asking for --host", code, err, cli.ExitUsage)
	}
	if _, code, err := runFtctl(t, "status", "--cluster", cfg, "--socket", "/nonexistent"); code != cli.ExitUsage {
		t.Errorf("--cluster with --socket: exit %d, %v; want %d", code, err, cli.ExitUsage)
	}

	// node2's agent goes away: its line names it, node1's results stay, and the exit status is 4.
	servers["node2"].Close()
	out, code, err = runFtctl(t, "status", "--json")
	if code != cli.ExitUnavailable || err == nil || !strings.Contains(err.Error(), "node2") || !strings.Contains(out, `"job-on-node1"`) {
		t.Errorf("status with node2 down: exit %d, %v\n%s; want 4 naming node2, node1's jobs shown", code, err, out)
	}
	out, code, err = runFtctl(t, "snapshots", "--json")
	if code != cli.ExitUnavailable || err == nil || !strings.Contains(err.Error(), "node2") || !strings.Contains(out, `"job-on-node1"`) {
		t.Errorf("snapshots with node2 down: exit %d, %v\n%s; want 4 naming node2 and node1's list", code, err, out)
	}
	// Only the seed down: nothing to ask.
	servers["node1"].Close()
	if _, code, err := runFtctl(t, "status"); code != cli.ExitUnavailable || !strings.Contains(err.Error(), "node1") {
		t.Errorf("status with every agent down: exit %d, %v; want 4 naming node1", code, err)
	}
}
