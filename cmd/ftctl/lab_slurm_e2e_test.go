package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/net/icmp"
	"golang.org/x/net/ipv4"

	"github.com/ftkit/ftkit/lab"
	"github.com/ftkit/ftkit/lab/labtest"
	"github.com/ftkit/ftkit/lab/slurm"
)

// requireSlurm skips loudly when Debian's Slurm is not installed, unless CI is set: then it fails.
func requireSlurm(t *testing.T) {
	t.Helper()
	missing := slurm.Missing()
	if len(missing) == 0 {
		return
	}
	if os.Getenv("CI") == "" {
		t.Skipf("SKIPPED LOUDLY: %s not installed (scripts/setup.sh packages installs slurmctld slurmd slurm-client munge); with CI set this fails", strings.Join(missing, ", "))
	}
	t.Fatalf("%s not installed and CI is set: run scripts/setup.sh packages", strings.Join(missing, ", "))
}

// printAddrs is the task the Slurm test runs on each node: the Slurm node it runs on and the IPv4
// addresses its network namespace has besides loopback.
func printAddrs() int {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	var out []string
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok && n.IP.To4() != nil && !n.IP.IsLoopback() {
			out = append(out, n.IP.String())
		}
	}
	fmt.Printf("%s %s\n", os.Getenv("SLURMD_NODENAME"), strings.Join(out, ","))
	return 0
}

// TestLabSlurm: `lab up --slurm` gives a working Slurm whose nodes are the lab's hosts; jobs report
// their exit status and final state; a crashed host comes back with `lab revive`, address and slurmd
// included; `lab down` leaves no daemon, state or namespace.
func TestLabSlurm(t *testing.T) {
	labtest.RequireRoot(t)
	requireSlurm(t)
	ftctl := buildFtctl(t)
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	id := fmt.Sprintf("s%05x", rand.Uint32()&0xfffff)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute) // a failure bound only
	defer cancel()
	ftctlCmd := func(args ...string) *exec.Cmd {
		return exec.CommandContext(ctx, ftctl, append([]string{"lab", "--lab", id}, args...)...)
	}
	run := func(args ...string) string {
		t.Helper()
		out, err := ftctlCmd(args...).Output()
		if err != nil {
			var stderr []byte
			if ee := (*exec.ExitError)(nil); errors.As(err, &ee) {
				stderr = ee.Stderr
			}
			t.Fatalf("ftctl lab %s: %v\n%s%s", strings.Join(args, " "), err, out, stderr)
		}
		return string(out)
	}

	upOut := labUp(t, ftctlCmd, "--no-agents", "--slurm", "--nodes", "3", "--spares", "1", "--json")
	var up lab.Status
	if err := json.Unmarshal(upOut, &up); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if l, err := lab.Open(id, lab.Options{}); err == nil {
			l.Down(context.Background()) // only does anything if the test failed before its own down
		}
	})
	addrOf := map[string]string{}
	for _, h := range up.Hosts {
		addrOf[h.Name] = h.Addr.Addr().String()
	}
	if up.SlurmConf == "" || len(up.Hosts) != 4 {
		t.Fatalf("lab up --slurm: %+v", up)
	}

	states, err := slurm.ParseSinfo(run(append([]string{"exec", "node1", "--", "sinfo"}, slurm.SinfoArgs...)...))
	if err != nil {
		t.Fatal(err)
	}
	if bad := slurm.NotIdle(states, []string{"node1", "node2", "node3", "spare1"}); len(bad) > 0 || len(states) != 4 {
		t.Fatalf("sinfo after lab up: %v, not idle: %v", states, bad)
	}

	// Reviving node1 restarts slurmctld too, with its saved state; every node takes jobs again. This
	// comes before any job: a power cut of the controller can lose the completion of a job that ended
	// moments before (its state is saved asynchronously), and Slurm then keeps that job's nodes
	// allocated, as a real controller without a backup would.
	run("crash", "node1")
	run("revive", "node1")
	states, err = slurm.ParseSinfo(run(append([]string{"exec", "node1", "--", "sinfo"}, slurm.SinfoArgs...)...))
	if bad := slurm.NotIdle(states, []string{"node1", "node2", "node3", "spare1"}); err != nil || len(bad) > 0 {
		t.Errorf("sinfo after reviving the controller's host: %v %v, not idle: %v", states, err, bad)
	}
	if out := run("exec", "node3", "--", "srun", "--nodes=4", "hostname"); strings.Count(out, "\n") != 4 {
		t.Errorf("srun -N 4 after reviving node1: %q", out)
	}

	// One task per node, each in its own host's namespace. The nodes are named: with all four idle, Slurm
	// may pick spare1 among any three (CI, ci295).
	cmd := ftctlCmd("exec", "node1", "--", "srun", "--nodes=3", "--nodelist=node1,node2,node3", "--ntasks-per-node=1", self)
	cmd.Env = append(os.Environ(), "FTKIT_E2E_ROLE=print-addrs")
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("srun -N 3: %v\n%s", err, out)
	}
	seen := map[string]bool{}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		node, addrs, _ := strings.Cut(line, " ")
		if seen[node] || addrs != addrOf[node] || !strings.HasPrefix(node, "node") {
			t.Errorf("srun task %q: want one task per node, each seeing only its host's address (%v)", line, addrOf)
		}
		seen[node] = true
	}
	if len(seen) != 3 {
		t.Errorf("srun -N 3 ran on %v, want node1..node3\n%s", seen, out)
	}

	// sbatch --wait returns the script's exit status; slurmctld keeps the job's final state.
	dir := t.TempDir()
	for _, tc := range []struct {
		exit  int
		state string
	}{{0, "COMPLETED"}, {3, "FAILED"}} {
		script := filepath.Join(dir, fmt.Sprintf("exit%d.sh", tc.exit))
		if err := os.WriteFile(script, []byte(fmt.Sprintf("#!/bin/sh\nexit %d\n", tc.exit)), 0o700); err != nil {
			t.Fatal(err)
		}
		out, err := ftctlCmd("exec", "node1", "--", "sbatch", "--wait", "--parsable", "--output=/dev/null", script).Output()
		code := 0
		if ee := (*exec.ExitError)(nil); errors.As(err, &ee) {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		jobID := strings.TrimSpace(string(out))
		if code != tc.exit || jobID == "" {
			t.Errorf("sbatch --wait of a script exiting %d: status %d, job %q", tc.exit, code, jobID)
			continue
		}
		// sbatch --wait returns once the script has exited; slurmctld may still show the job COMPLETING (its
		// epilog and cleanup on the node) for a moment before its final state (ci247).
		show := run("exec", "node1", "--", "scontrol", "--oneliner", "show", "job", jobID)
		for deadline := time.Now().Add(time.Minute); strings.Contains(show, "JobState=COMPLETING ") && time.Now().Before(deadline); {
			time.Sleep(50 * time.Millisecond)
			show = run("exec", "node1", "--", "scontrol", "--oneliner", "show", "job", jobID)
		}
		for _, want := range []string{"JobState=" + tc.state + " ", fmt.Sprintf("ExitCode=%d:0", tc.exit)} {
			if !strings.Contains(show, want) {
				t.Errorf("job %s exiting %d: scontrol lacks %q:\n%s", jobID, tc.exit, want, show)
			}
		}
		// Slurm's accounting view, from the lab's job completion file (no slurmdbd).
		want := fmt.Sprintf("%s|%s|%d:0", jobID, tc.state, tc.exit)
		if acct := run("exec", "node1", "--", "sacct", "--completion", "-j", jobID, "--noheader", "--parsable2", "--format=JobID,State,ExitCode"); strings.TrimSpace(acct) != want {
			t.Errorf("sacct --completion -j %s: %q; want %q", jobID, acct, want)
		}
	}

	// A crashed host comes back with its original address and its slurmd.
	run("crash", "node2")
	run("revive", "node2")
	l, err := lab.Open(id, lab.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := pingFrom(ctx, l, "node1", addrOf["node2"]); err != nil {
		t.Errorf("revived node2 does not answer ping from node1 at %s: %v", addrOf["node2"], err)
	}
	var st lab.Status
	if err := json.Unmarshal([]byte(run("status", "--json")), &st); err != nil {
		t.Fatal(err)
	}
	if h := st.Hosts[1]; h.Name != "node2" || h.Crashed || !h.Exists || !h.LinkUp || len(h.Addrs) != 1 || h.Addrs[0] != up.Hosts[1].Addr {
		t.Errorf("node2 after revive: %+v, want up at %s", h, up.Hosts[1].Addr)
	}
	cmd = ftctlCmd("exec", "node1", "--", "srun", "--nodelist=node2", self)
	cmd.Env = append(os.Environ(), "FTKIT_E2E_ROLE=print-addrs")
	if out, err := cmd.Output(); err != nil || strings.TrimSpace(string(out)) != "node2 "+addrOf["node2"] {
		t.Errorf("srun on the revived node2: %q, %v", out, err)
	}

	l, err = lab.Open(id, lab.Options{}) // the daemons revive started
	if err != nil {
		t.Fatal(err)
	}
	recorded := l.State().Slurm
	if len(recorded.Daemons) != 5 {
		t.Fatalf("recorded Slurm daemons %+v, want slurmctld and 4 slurmd", recorded.Daemons)
	}
	run("down")
	assertNoLeftovers(t, up)
	for _, p := range recorded.Daemons {
		if p.Alive() {
			t.Errorf("%s of %s (pid %d) survives lab down", p.Name, p.Host, p.PID)
		}
	}
	if recorded.Munged != nil && recorded.Munged.Alive() && !otherSlurmLab(t) {
		t.Errorf("the munged this lab started (pid %d) survives lab down", recorded.Munged.PID)
	}
	if _, err := os.Stat(recorded.Dir); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("Slurm directory %s left behind: %v", recorded.Dir, err)
	}
	if pids := processesMentioning(up.SlurmConf); len(pids) > 0 {
		t.Errorf("processes %v still use %s after lab down", pids, up.SlurmConf)
	}
}

// otherSlurmLab says whether another lab with Slurm is up, which inherits the munged of a lab going down.
func otherSlurmLab(t *testing.T) bool {
	labs, err := lab.List(lab.Options{})
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range labs {
		if s.Slurm != nil {
			return true
		}
	}
	return false
}

// processesMentioning lists the processes whose command line contains s.
func processesMentioning(s string) []string {
	cmdlines, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	var out []string
	for _, p := range cmdlines {
		if b, err := os.ReadFile(p); err == nil && strings.Contains(string(b), s) {
			out = append(out, filepath.Base(filepath.Dir(p)))
		}
	}
	return out
}

// pingFrom sends ICMP echo requests from host until dst answers (or ctx ends).
func pingFrom(ctx context.Context, l *lab.Lab, host, dst string) error {
	var conn *icmp.PacketConn
	// The socket belongs to the namespace it is created in, wherever it is used afterwards.
	if err := l.Do(host, func() (err error) {
		conn, err = icmp.ListenPacket("ip4:icmp", "0.0.0.0")
		return err
	}); err != nil {
		return err
	}
	defer conn.Close()
	to := &net.IPAddr{IP: net.IP(netip.MustParseAddr(dst).AsSlice())}
	id := os.Getpid() & 0xffff
	for seq := 1; ctx.Err() == nil; seq++ {
		req, _ := (&icmp.Message{Type: ipv4.ICMPTypeEcho, Body: &icmp.Echo{ID: id, Seq: seq, Data: []byte("ftkit")}}).Marshal(nil)
		if _, err := conn.WriteTo(req, to); err != nil {
			return err
		}
		conn.SetReadDeadline(time.Now().Add(time.Second))
		buf := make([]byte, 1500)
		for {
			n, from, err := conn.ReadFrom(buf)
			if err != nil {
				break // no reply within a second: send another request
			}
			m, err := icmp.ParseMessage(1, buf[:n])
			if err != nil || from.String() != dst || m.Type != ipv4.ICMPTypeEchoReply {
				continue
			}
			if e, ok := m.Body.(*icmp.Echo); ok && e.ID == id && e.Seq == seq {
				return nil
			}
		}
	}
	return ctx.Err()
}
