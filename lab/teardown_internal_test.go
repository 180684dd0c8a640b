package lab

import (
	"context"
	"testing"
	"time"

	"github.com/ftkit/ftkit/internal/testenv"
)

// TestCrashWhileAnotherLabTearsDown: a lab's teardown (seconds with GBs of snapshots to remove) runs without
// the lock every lab of the machine shares, so a test that power-cuts a host of its own lab meanwhile gets
// its fault now, not after the other lab is gone (ci: a dump that should have been cut short completed).
func TestCrashWhileAnotherLabTearsDown(t *testing.T) {
	testenv.RequireKernel(t, "network namespaces")
	stateDir := t.TempDir()
	a, b := upOneNodeLab(t, stateDir), upOneNodeLab(t, stateDir)
	crashed := make(chan error, 1)
	a.tearingDown = func() {
		go func() { crashed <- b.Crash(context.Background(), "node1") }()
		select {
		case err := <-crashed:
			if err != nil {
				t.Errorf("crash lab %s's node1 during lab %s's teardown: %v", b.st.ID, a.st.ID, err)
			}
		case <-time.After(time.Minute): // a bound for the failure only: the crash takes milliseconds
			t.Errorf("crashing lab %s's node1 waited 1m for lab %s's teardown: it holds the store's lock", b.st.ID, a.st.ID)
		}
	}
	if err := a.Down(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := a.store.load(a.st.ID); err == nil {
		t.Errorf("lab %s's state is still there after its Down", a.st.ID)
	}
	st, err := b.store.load(b.st.ID)
	if err != nil {
		t.Fatal(err)
	}
	if h, _ := st.Host("node1"); !h.Crashed {
		t.Errorf("lab %s's node1 is not recorded as crashed: %+v", b.st.ID, h)
	}
}
