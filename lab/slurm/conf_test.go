package slurm

import (
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

func testConf() Conf {
	return Conf{
		ClusterName:    "ftkit-t1",
		ControllerHost: "vm",
		ControllerAddr: netip.MustParseAddr("10.9.0.11"),
		Dir:            "/run/ftkit/labs/t1.slurm",
		Partition:      "lab",
		Nodes: []Node{
			{"node1", netip.MustParseAddr("10.9.0.11")},
			{"node2", netip.MustParseAddr("10.9.0.12")},
			{"spare1", netip.MustParseAddr("10.9.0.101")},
		},
	}
}

func TestRender(t *testing.T) {
	out, err := Render(testConf())
	if err != nil {
		t.Fatal(err)
	}
	lines := map[string]bool{}
	for _, l := range strings.Split(out, "\n") {
		lines[l] = true
	}
	for _, want := range []string{
		"ClusterName=ftkit-t1",
		"SlurmctldHost=vm(10.9.0.11)",
		"StateSaveLocation=/run/ftkit/labs/t1.slurm/ctld",
		"SlurmdSpoolDir=/run/ftkit/labs/t1.slurm/spool/%n",
		"SlurmdPidFile=/run/ftkit/labs/t1.slurm/run/slurmd-%n.pid",
		"ProctrackType=proctrack/linuxproc",
		"TaskPlugin=task/none",
		"JobAcctGatherType=jobacct_gather/none",
		"AccountingStorageType=accounting_storage/none",
		"MpiDefault=none",
		"NodeName=node1 NodeAddr=10.9.0.11 CPUs=1 State=UNKNOWN",
		"NodeName=node2 NodeAddr=10.9.0.12 CPUs=1 State=UNKNOWN",
		"NodeName=spare1 NodeAddr=10.9.0.101 CPUs=1 State=UNKNOWN",
		"PartitionName=lab Nodes=node1,node2,spare1 Default=YES MaxTime=INFINITE State=UP",
	} {
		if !lines[want] {
			t.Errorf("slurm.conf lacks line %q:\n%s", want, out)
		}
	}
	// No cgroup plugin may appear: the agents own their jobs' cgroups.
	if strings.Contains(out, "cgroup") {
		t.Errorf("slurm.conf mentions cgroup:\n%s", out)
	}
	again, _ := Render(testConf())
	if again != out {
		t.Error("Render is not deterministic")
	}
}

func TestRenderRejects(t *testing.T) {
	for _, tc := range []struct {
		name   string
		modify func(*Conf)
		want   string
	}{
		{"no nodes", func(c *Conf) { c.Nodes = nil }, "no nodes"},
		{"repeated node", func(c *Conf) { c.Nodes = append(c.Nodes, c.Nodes[0]) }, "repeated"},
		{"node name with a blank", func(c *Conf) { c.Nodes[1].Name = "node 2" }, "node name"},
		{"node name injecting a key", func(c *Conf) { c.Nodes[1].Name = "n\nSlurmUser=x" }, "node name"},
		{"IPv6 node", func(c *Conf) { c.Nodes[0].Addr = netip.MustParseAddr("fd00::1") }, "not IPv4"},
		{"no node address", func(c *Conf) { c.Nodes[0].Addr = netip.Addr{} }, "not IPv4"},
		{"no controller address", func(c *Conf) { c.ControllerAddr = netip.Addr{} }, "controller address"},
		{"relative dir", func(c *Conf) { c.Dir = "run/slurm" }, "directory"},
		{"dir with a blank", func(c *Conf) { c.Dir = "/run/my labs" }, "directory"},
		{"dir with %", func(c *Conf) { c.Dir = "/run/%n" }, "directory"},
		{"empty hostname", func(c *Conf) { c.ControllerHost = "" }, "controller host"},
		{"hostname with ()", func(c *Conf) { c.ControllerHost = "vm(1)" }, "controller host"},
		{"empty partition", func(c *Conf) { c.Partition = "" }, "partition"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := testConf()
			c.Nodes = append([]Node(nil), c.Nodes...)
			tc.modify(&c)
			out, err := Render(c)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Render = %q, %v; want an error about %q", out, err, tc.want)
			}
		})
	}
}

// TestTaskPrologScript: the task prolog prints the export line of the task's own host's agent socket, and
// nothing for a node name a shell could misread; sockets that would need quoting are refused.
func TestTaskPrologScript(t *testing.T) {
	script, err := TaskPrologScript("/run/ftkit/labs/t1.d/%n/agent.sock")
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	path := filepath.Join(dir, "prolog")
	if err := os.WriteFile(path, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	for node, want := range map[string]string{
		"node2":      "export FTKIT_AGENT_SOCKET=/run/ftkit/labs/t1.d/node2/agent.sock\n",
		"":           "",
		"a b":        "",
		"x;rm -rf /": "",
	} {
		cmd := exec.Command(path)
		cmd.Env = []string{"SLURMD_NODENAME=" + node, "PATH=/usr/bin:/bin"}
		out, err := cmd.Output()
		if err != nil || string(out) != want {
			t.Errorf("node %q: %q, %v; want %q", node, out, err, want)
		}
	}
	for _, bad := range []string{"relative/%n/agent.sock", "/run/no-node-name.sock", "/run/$(x)/%n.sock", "/run/a b/%n.sock"} {
		if _, err := TaskPrologScript(bad); err == nil {
			t.Errorf("socket %q accepted", bad)
		}
	}
	c := testConf()
	c.TaskProlog = "/run/ftkit/labs/t1.slurm/task-prolog"
	out, err := Render(c)
	if err != nil || !strings.Contains(out, "\nTaskProlog=/run/ftkit/labs/t1.slurm/task-prolog\n") {
		t.Errorf("Render with a task prolog: %v\n%s", err, out)
	}
}

// TestStartJobWrapper: the lab's start-job command runs the given script with every argument as it came
// (an empty Slurm job id too) and SLURM_CONF set to the lab's slurm.conf, from PATH alone (as the agent
// runs it); paths a shell would misread are refused.
func TestStartJobWrapper(t *testing.T) {
	dir := t.TempDir()
	script := filepath.Join(dir, "ftkit-start-job-slurm")
	if err := os.WriteFile(script, []byte("#!/bin/sh\necho \"conf=$SLURM_CONF n=$#\"\nfor a; do echo \"[$a]\"; done\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	wrapper, err := StartJobWrapper("/run/ftkit/labs/t1.slurm/slurm.conf", script)
	if err != nil {
		t.Fatal(err)
	}
	path := StartJobCommandPath(dir)
	if err := os.WriteFile(path, []byte(wrapper), 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(path, "1000", "100", "node2", "node1", "")
	cmd.Env = []string{"PATH=/usr/bin:/bin"}
	out, err := cmd.Output()
	if want := "conf=/run/ftkit/labs/t1.slurm/slurm.conf n=5\n[1000]\n[100]\n[node2]\n[node1]\n[]\n"; err != nil || string(out) != want {
		t.Errorf("wrapper: %q, %v; want %q", out, err, want)
	}
	for _, bad := range [][2]string{{"relative/slurm.conf", script}, {"/run/a b/slurm.conf", script}, {"/run/slurm.conf", "/run/$(x)/script"}} {
		if _, err := StartJobWrapper(bad[0], bad[1]); err == nil {
			t.Errorf("paths %q accepted", bad)
		}
	}
	if got := StartJobCommand(dir); got[0] != path || len(got) != 6 {
		t.Errorf("StartJobCommand(%s) = %q", dir, got)
	}
}
