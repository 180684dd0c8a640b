package agent

import (
	"context"
	"fmt"
	"net/netip"
	"testing"
	"time"

	"github.com/ftkit/ftkit/clusterapi"
	"github.com/ftkit/ftkit/ring"
)

// viewWinner answers pings, and a view push of won's epoch with won if won takes the tie-break (another
// member's change of the same epoch, made at the same time); any other push it takes as it is.
type viewWinner struct {
	pingScript
	won ring.View
}

func (s *viewWinner) View(_ context.Context, _ string, in clusterapi.ViewMessage) (clusterapi.ViewMessage, error) {
	pushed, err := ring.Decode(in.View)
	if err != nil {
		return clusterapi.ViewMessage{}, err
	}
	if pushed.Epoch == s.won.Epoch && ring.Newer(pushed, s.won) {
		b, err := ring.Encode(s.won)
		return clusterapi.ViewMessage{View: b}, err
	}
	return in, nil
}

// TestAddSpareSurvivesATieBreak: a spare is registered through n1 while another member made a view of the
// same epoch (another spare registered through it) that wins the tie-break: n1 adopts that view when it
// pushes its own. Before, the spare was gone from every view for good, its registration reported done.
func TestAddSpareSurvivesATieBreak(t *testing.T) {
	pki := newTestPKI(t)
	s9 := &viewWinner{pingScript: pingScript{name: "s9"}}
	s9Port := scriptedPeer(t, pki, "s9", s9)
	n2 := &viewWinner{pingScript: pingScript{name: "n2"}}
	a, logs := clientAgent(t, pki, map[string]uint16{"n2": scriptedPeer(t, pki, "n2", n2)})
	req := SpareRequest{Name: "s9", Address: netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), s9Port)}

	base := a.View()
	mine, err := base.AddSpare(ring.Member{Name: req.Name, Address: req.Address, Role: ring.RoleSpare, State: ring.StateAlive})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 1000 {
		v, err := base.AddSpare(ring.Member{Name: fmt.Sprintf("x%d", i), Address: netip.AddrPortFrom(netip.MustParseAddr("127.0.0.2"), uint16(100+i)),
			Role: ring.RoleSpare, Addrs: []netip.Addr{netip.AddrFrom4([4]byte{10, 78, byte(i >> 8), byte(i)})}})
		if err != nil {
			t.Fatal(err)
		}
		if ring.Newer(mine, v) {
			n2.won, s9.won = v, v
			break
		}
	}
	if n2.won.Epoch == 0 {
		t.Fatal("no view of the same epoch wins the tie-break")
	}

	ctx, cancel := context.WithCancel(t.Context())
	defer cancel() // ends the registration's watch over the views
	got, err := a.AddSpare(ctx, req)
	if err != nil {
		t.Fatalf("AddSpare: %v; log:\n%s", err, logs.String())
	}
	for _, v := range []ring.View{got, a.View()} {
		if _, ok := v.Member("s9"); !ok {
			t.Fatalf("view %d lists no s9: its registration lost the tie-break with another view of epoch %d for good; log:\n%s", v.Epoch, n2.won.Epoch, logs.String())
		}
		if _, ok := v.Member(n2.won.Members[len(n2.won.Members)-1].Name); !ok {
			t.Errorf("view %d lost the other member's spare", v.Epoch)
		}
	}
}

// TestRejoinSurvivesATieBreak: n1 admits n3 back as a spare while another member made a view of the same
// epoch (a spare registered through it) that wins the tie-break: the push of the rejoin brings it back, n3
// failed in it again. Before, nobody admitted n3 again: no member pushes views to a failed one, and n3, an
// alive spare in its own view, never asked again, left out of the cluster until its agent restarted.
func TestRejoinSurvivesATieBreak(t *testing.T) {
	pki := newTestPKI(t)
	n3 := &viewWinner{pingScript: pingScript{name: "n3"}}
	a, logs := clientAgent(t, pki, map[string]uint16{"n3": scriptedPeer(t, pki, "n3", n3)})
	failed, err := a.View().ReplaceKeepingAddrs("n3", "s1")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.adoptView(failed); err != nil {
		t.Fatal(err)
	}
	mine, err := failed.Rejoin("n3", 0)
	if err != nil {
		t.Fatal(err)
	}
	for i := range 1000 {
		v, err := failed.AddSpare(ring.Member{Name: fmt.Sprintf("x%d", i), Address: netip.AddrPortFrom(netip.MustParseAddr("127.0.0.2"), uint16(100+i)),
			Role: ring.RoleSpare, Addrs: []netip.Addr{netip.AddrFrom4([4]byte{10, 78, byte(i >> 8), byte(i)})}})
		if err != nil {
			t.Fatal(err)
		}
		if ring.Newer(mine, v) {
			n3.won = v
			break
		}
	}
	if n3.won.Epoch == 0 {
		t.Fatal("no view of the same epoch wins the tie-break")
	}

	ctx, cancel := context.WithCancel(t.Context())
	defer cancel() // ends the rejoin's watch over the views
	if _, err := a.serveRejoin(ctx, "n3", clusterapi.RejoinRequest{Incarnation: 0}); err != nil {
		t.Fatalf("rejoin refused: %v", err)
	}
	lost := false
	for deadline := time.Now().Add(failAfter); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		v := a.View()
		m, _ := v.Member("n3")
		if v.Epoch > mine.Epoch && m.State == ring.StateAlive && m.Incarnation == 1 {
			return
		}
		lost = lost || v.Epoch == n3.won.Epoch && m.State == ring.StateFailed
	}
	m, _ := a.View().Member("n3")
	t.Fatalf("view %d lists n3 %s as incarnation %d (tie-break lost: %v): admitted back, it is failed for good; log:\n%s",
		a.View().Epoch, m.State, m.Incarnation, lost, logs.String())
}
