package e2e

import (
	"context"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/ftkit/ftkit/agent"
	"github.com/ftkit/ftkit/lab/labcluster"
)

// TestMPIJobAddresses: LAMMPS under `ftctl mpirun --job-addresses`, one rank per lab node: every host's part
// of the run (mpirun or orted, the rank, PMIx between them) runs in a job network of its own and every
// connection of the run is between job addresses; node2 crashes mid-run and its part is restored on spare1
// with node2's job address, which nobody's host address is: the output equals the failure-free run's, the
// other hosts' jobs are never disturbed, and node2's host address is nowhere but on node2.
func TestMPIJobAddresses(t *testing.T) {
	t.Parallel() // each test has its own lab (labSlots: how many run at once)
	requirePrograms(t, "mpirun.openmpi", "lmp")
	in := meltInput(t)
	c := newMPICluster(t, 3, 1, labcluster.Options{Interval: "1h", JobAddresses: true})
	st := c.Lab.State()
	flags := []string{"--job-addresses"}

	ref := startMPIWith(t, c, flags, "ref", "in.melt", in, "lmp", "-in", "in.melt")
	ref.wait(t)
	want := thermo(t, ref.out.String())

	r := startMPIWith(t, c, flags, "ft", "in.melt", in, "lmp", "-in", "in.melt")
	r.waitRows(t, thermoRows, 1, 2*time.Minute)
	jobs := map[string]agent.Job{}
	addrs := map[netip.Addr]bool{}
	for _, h := range []string{"node1", "node2", "node3"} {
		j := jobNamed(t, c, h, "ft-"+h)
		if j.Net == nil || !labcluster.JobPool(st, h).Contains(j.Net.Addr.Addr()) {
			t.Fatalf("%s's job of the run: net %+v, want a job address of %s's pool %s", h, j.Net, h, labcluster.JobPool(st, h))
		}
		t.Cleanup(func() { removeJobNets(t, j.ID) }) // before the lab goes (the restored copy has the same id)
		requireInJobNet(t, c, j)
		jobs[h] = j
		addrs[j.Net.Addr.Addr()] = true
	}
	waitProtected(t, c, "node2", jobs["node2"].ID, time.Minute)
	reply, err := c.Client("node2").Checkpoint(context.Background())
	if err != nil || reply.Error != "" || len(reply.Results) != 1 || !reply.Results[0].Shipped {
		t.Fatalf("checkpoint of node2: %+v %v\n%s", reply, err, r.out.String())
	}
	// MPI's daemons, ranks and PMIx: every connection of node2's part is between job addresses of the run.
	own := jobs["node2"].Net.Addr.Addr()
	m := reply.Results[0].Manifest
	if len(m.Conns) == 0 {
		t.Fatalf("node2's snapshot %s has no connection", m.ID)
	}
	for _, conn := range m.Conns {
		if conn.Local.Addr().Unmap() != own || !addrs[conn.Remote.Addr().Unmap()] {
			t.Errorf("node2's connection %s -> %s: want both ends on the run's job addresses %v", conn.Local, conn.Remote, addrs)
		}
	}
	// node1's log attributes what it sent to node2's job address to node2: the agents know who holds it.
	poll(t, time.Minute, "node1's log to attribute node2's job address to node2", func() bool {
		conns, err := c.Client("node1").LoggedConns(context.Background())
		return err == nil && slices.ContainsFunc(conns, func(lc agent.LoggedConn) bool {
			return lc.Dst.Addr().Unmap() == own && lc.DstNode == "node2"
		})
	})
	r.waitRows(t, thermoRows, thermoRows(r.out.String())+1, time.Minute)
	if err := c.Lab.Crash(context.Background(), "node2"); err != nil {
		t.Fatal(err)
	}
	crashJobNet(t, jobs["node2"].Net.Name)
	f := waitFailure(t, c, "node2", 5*time.Minute)
	requireStages(t, f)
	r.wait(t)
	if got := thermo(t, r.out.String()); got != want {
		t.Errorf("thermo output after fail-over:\n%s\nwithout failure:\n%s", got, want)
	}
	for _, h := range []string{"node1", "node3"} {
		if a := jobNamed(t, c, h, "ft-"+h); a.PID != jobs[h].PID || a.Restored != "" {
			t.Errorf("%s's job was disturbed: pid %d -> %d, restored from %q", h, jobs[h].PID, a.PID, a.Restored)
		}
	}
	moved, err := c.Client("spare1").Wait(context.Background(), jobNamed(t, c, "spare1", "ft-node2").ID, 10*time.Second)
	if err != nil || moved.Restored == "" || moved.Exit == nil || moved.Exit.Code != 0 || moved.Net == nil || moved.Net.Addr.Addr() != own {
		t.Errorf("node2's job on spare1: restored from %q, exit %+v, net %+v (%v); want node2's job address %s", moved.Restored, moved.Exit, moved.Net, err, own)
	}
	node2, _ := c.Lab.Host("node2")
	if slices.Contains(hostAddrs(t, c, "spare1"), node2.Addr.Addr()) {
		t.Errorf("spare1 took node2's host address %s: with job addresses only the job's moves", node2.Addr.Addr())
	}
}
