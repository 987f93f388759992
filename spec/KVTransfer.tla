----------------------------- MODULE KVTransfer -----------------------------
(***************************************************************************)
(* The KV-cache transfer protocol of disaggregated LLM serving:            *)
(* router -> prefill -> decode, with paged KV pools on both sides.         *)
(*                                                                         *)
(* A request arrives at the router, which checks the prompt against the    *)
(* advertised context, queues it at the prefill and sends a bootstrap to   *)
(* decode. Decode reserves one page per prompt page, stamping each with a  *)
(* fresh generation (the page's ownership tag), and sends its page table   *)
(* to the prefill. The prefill allocates source pages, computes the KV     *)
(* into them and posts one write per page; a write lands later, carrying   *)
(* the data of its source page at landing time and the tag it was          *)
(* addressed with, and decode counts it. Once every write has completed    *)
(* the prefill sends its final word Done (with the count it posted) and    *)
(* frees its sources. Decode accepts only if the count equals what it      *)
(* reserved and the checksums match, then decodes, comparing every page's  *)
(* tag with the generation it reserved (Finish) and, with PrefixCache, the *)
(* content identity its own tokens and salt imply (TagIdent).              *)
(*                                                                         *)
(* The prefill's final word is Done, Reject or Abort, each with the count  *)
(* of writes posted. Decode releases a request's pages only after that     *)
(* final word has arrived and as many writes as it announced have landed;  *)
(* when decode gives up (timeout, client abort,                            *)
(* prompt too long for its pool) it asks for the final word with a cancel, *)
(* which an ended prefill answers by repeating it. Messages overtake each  *)
(* other, so a final word that beats the bootstrap leaves a tombstone and  *)
(* the late bootstrap is dropped. Pages are never zeroed: a freed page     *)
(* keeps its content, and a fresh pool carries the invalid tag -1.         *)
(*                                                                         *)
(* Every action reads only its own worker's variables and the messages     *)
(* addressed to it (the comments on VARIABLES say who owns each; the one   *)
(* ghost, leaked, is history for the properties): spec/tlaplus/locality.py *)
(* checks it from this text.                                               *)
(*                                                                         *)
(* Workers. The router places every request it admits on one prefill     *)
(* worker of PrefillWorkers and one decode worker of DecodeWorkers         *)
(* (pworker, dworker), any of them: each worker has a pool of its own      *)
(* (powner[q], owner[d], ...), and a request's actions read and write only *)
(* its own workers' pools, so the checker explores every placement. A      *)
(* worker crashes alone (PrefillCrash(q), DecodeCrash(d)), taking only its *)
(* requests, its pool and its writes with it; each decode worker has its   *)
(* own epochs (its tombstones).                                            *)
(*                                                                         *)
(* Prefix caching (PrefixCache, off in most models): decode keeps the      *)
(* pages of an accepted transfer sealed under their content identity       *)
(* <<salt, tokens of the page and every page before it>>, a later request  *)
(* with the same salt and prefix references them at Reserve, and the       *)
(* prefill sends only the tail; Release drops the reference, Evict forgets *)
(* a page no request reads. See "Prefix caching" below and spec/README.md. *)
(* With PrefillCache the prefill caches what it computed too: Admit        *)
(* references the longest cached prefix and computes only the rest,       *)
(* SendPage may read a shared cached source, SendDone seals, PrefillEvict  *)
(* forgets a page nobody reads or sends from (EvictWhileSending ignores    *)
(* that), and a prefill crash wipes its cache.                             *)
(*                                                                         *)
(* Every guard can be switched off by an element of the constant Bugs, so  *)
(* one spec serves the correct protocol and every bug of the zoo. The      *)
(* Python core (spec/core.py) implements the same actions with the same    *)
(* names; spec/tlaview.py maps its states to these variables.              *)
(*                                                                         *)
(* Check with TLC using a .cfg from this directory, e.g. default.cfg.      *)
(* Those models need CHECK_DEADLOCK FALSE: a state where every request has *)
(* ended has no successor, and NoLeakAtRest / NoStuckRequest decide        *)
(* whether a state without a fair successor is a good one.                 *)
(***************************************************************************)
EXTENDS Integers, Sequences, FiniteSets, TLC

CONSTANTS
    Requests,        \* the requests (model values)
    NoReq,           \* "no request" (a model value)
    PrefillWorkers,  \* the prefill workers (model values), each with a pool of PrefillPages
    DecodeWorkers,   \* the decode workers (model values), each with a pool of DecodePages
    NoWorker,        \* "placed nowhere" (a model value)
    MaxPromptPages,  \* longest prompt a client may send, in pages
    ContextPages,    \* context the deployment is configured to advertise, in pages
    PrefillPages,    \* size of each prefill worker's KV pool, in pages
    DecodePages,     \* size of each decode worker's KV pool, in pages
    Crashes,         \* whether each prefill worker may crash and restart (BOOLEAN)
    DecodeCrashes,   \* whether each decode worker may crash and restart (BOOLEAN)
    EarlyTimeouts,   \* whether a decode timer may fire while the prefill is still at work
                     \*   on the request (BOOLEAN; see Timeout)
    Losses,          \* what the network may lose for good (a subset of LossKinds; see Lose)
    PrefixCache,     \* whether decode caches sealed pages by content identity and shares
                     \*   them between requests (BOOLEAN; see "Prefix caching")
    Tokens,          \* with PrefixCache: how many distinct abstract tokens a prompt page
                     \*   may hold (a prompt is a sequence of them, one per page)
    Tenants,         \* with PrefixCache: how many salts (tenants) a request may carry
    PrefillCache,    \* whether the prefill caches the pages it computed by content identity
                     \*   too, and computes only the uncached suffix (BOOLEAN; needs
                     \*   PrefixCache; see "Prefill-side caching")
    Bugs             \* the bug switches that are on (a set of strings)

BugNames == {"FinishedNotRejected", "NoCountCheck", "EagerRelease", "SourceReuse",
             "NoAbortNotice", "NoTimeout", "PoolBelowContext", "NoGenBump",
             "NoChecksum", "NoTombstone", "NoCancel", "AdmitBeforeReserve",
             "StopwatchTimeout", "EarlyDone", "NoLandedCount", "GenerationReset",
             "NoEpochCheck", "NoRetransmit", "NoRevoke", "NoFailureDetector",
             "StaleHitLength", "NoRefCount", "FullHitNoNotice", "NoSalt",
             "EvictWhileSending", "NoIdentTag"}

LossKinds == {"Bootstrap", "FinalWord", "Cancel", "Write"}

ASSUME /\ NoReq \notin Requests
       /\ PrefillWorkers # {} /\ DecodeWorkers # {}
       /\ NoWorker \notin PrefillWorkers \cup DecodeWorkers
       /\ Bugs \subseteq BugNames
       /\ Losses \subseteq LossKinds
       /\ MaxPromptPages \in Nat \ {0}
       /\ ContextPages \in Nat \ {0}
       /\ PrefillPages \in Nat \ {0}
       /\ DecodePages \in Nat \ {0}
       /\ Crashes \in BOOLEAN
       /\ DecodeCrashes \in BOOLEAN
       /\ EarlyTimeouts \in BOOLEAN
       /\ PrefixCache \in BOOLEAN
       /\ Tokens \in Nat \ {0}
       /\ Tenants \in Nat \ {0}
       /\ PrefillCache \in BOOLEAN
       /\ PrefillCache => PrefixCache

PPages == 1..PrefillPages
DPages == 1..DecodePages
Min(a, b) == IF a < b THEN a ELSE b

(* The startup check: a node advertises no more context than its pools hold. Every   *)
(* worker's pools are alike, so every worker has room for every prompt the router     *)
(* admits: that is the room the router places by (Arrive). Whether a worker's pages    *)
(* are free now only the worker knows; one without free pages keeps the request       *)
(* waiting (Reserve and Admit wait for free pages).                                   *)
Advertised == IF "PoolBelowContext" \in Bugs
                THEN ContextPages
                ELSE Min(ContextPages, Min(PrefillPages, DecodePages))

ClientStates == {"Idle", "Waiting", "Ok", "Gone", "ErrTooLong", "ErrPrefill",
                 "ErrTransfer", "ErrTag", "ErrTimeout", "ErrDecode"}
PrefillStates == {"None", "Queued", "Running", "Done", "Rejected", "Aborted"}
DecodeStates == {"None", "Waiting", "Decoding", "Closing", "Released", "Tomb"}
Messages == {"None", "Done", "Reject", "Abort"}

VARIABLES
    client,   \* router: what the client sees (the serving edge keeps the first answer)
    prompt,   \* router: prompt length in pages (0 before arrival); the prefill's queue
              \*   entry and decode's bootstrap carry it
    pst,      \* prefill: its state per request
    sent,     \* prefill: pages whose write it has posted
    src,      \* prefill: its source pages, in order
    dst,      \* decode: its state per request
    table,    \* decode: its page table <<[page, gen]>>, fixed once reserved
    boot,     \* wire, router -> decode: the bootstrap in flight
    fwMsg,    \* wire, prefill -> decode: the prefill's final word in flight
    dfw,      \* decode: it holds the prefill's final word
    cancel,   \* wire, decode -> prefill: a cancel in flight
    ptable,   \* prefill: decode's page table as the prefill received it
    fwCount,  \* wire, prefill -> decode: the count of writes the final word announces
    announced, \* decode: the count of writes the final word it holds announced
    landed,   \* decode: writes into its pages it has seen land, per request
    leaked,   \* ghost (history, for the properties): requests that consumed foreign data
    pworker,  \* router: the prefill worker it placed the request on (NoWorker: none); the
              \*   queue entry reaches that worker, which so knows its own requests
    dworker,  \* router: the decode worker it placed the request on; the bootstrap reaches it
    tokens,   \* router: the prompt's tokens, one abstract token per page (<<>> before
              \*   arrival, and without PrefixCache); queue entry and bootstrap carry them
    salt,     \* router: the request's salt, its tenant (0 before arrival, and without
              \*   PrefixCache); queue entry and bootstrap carry it
    hit,      \* decode: how many leading pages of the prompt it holds cached for the
              \*   request (it reads them, the prefill sends none of them)
    phit,     \* prefill: the hit length decode told it with the page table
    pcached,  \* prefill: how many leading pages of the prompt it found in its own cache at
              \*   Admit (PrefillCache; it computes only the rest)
    owner,    \* decode: owner of each page of each worker's pool, owner[d][p]
    gen,      \* decode: generation (ownership tag) of each page, gen[d][p]
    content,  \* decode: each page's memory, <<whose data, tag it was written with>>: the
              \*   tag is a generation and a content identity (NoIdent without PrefixCache)
    readers,  \* decode: the requests that read each sealed page, readers[d][p]
    ident,    \* decode: each page's content identity in its cache index, ident[d][p]:
              \*   <<>> for a page not cached, else <<salt, tokens of the page and of
              \*   every page before it>> (a page with one is sealed: immutable, shared)
    kv,       \* decode: the content identity of the KV each page's memory holds
              \*   (<<>> until a write lands in it; never cleared)
    powner,   \* prefill: owner of each page of each worker's pool, powner[q][p]
    pdata,    \* prefill: each page's memory (whose KV it holds)
    preaders, \* prefill: the requests that read each of its sealed pages as a cached source,
              \*   preaders[q][p] (PrefillCache)
    pident,   \* prefill: each page's content identity in its own cache index, pident[q][p]
              \*   (<<>>: not cached; PrefillCache)
    writes    \* prefill: its send queue, the writes it posted whose completion has not
              \*   come back (the network lands them); a write's pages are in its
              \*   request's workers' pools

vars == <<client, prompt, pst, sent, src, dst, table, boot, fwMsg, dfw, cancel, ptable,
          fwCount, announced, landed, leaked, pworker, dworker, tokens, salt, hit, phit, pcached,
          owner, gen, content, readers, ident, kv, powner, pdata, preaders, pident, writes>>

Range(q) == {q[i] : i \in DOMAIN q}
NoIdent == <<>>
(* A write in flight reads prefill page p of worker q (the NIC reads it when it lands). *)
SentFrom(q, p) == \E w \in writes : pworker[w.req] = q /\ w.src = p
(* A cached prefill page the prefill may forget (PrefillEvict) or allocate anew: no        *)
(* request reads it as a cached source and no write in flight still reads out of it.       *)
(* EvictWhileSending (TRT-LLM #12542, vLLM #52360): the cache ignores both, so a page an    *)
(* async send still reads is evicted, and reused by the next allocation. An IF, not a      *)
(* disjunction (see LeaseLapsed).                                                          *)
PrefillEvictable(q, p) == IF "EvictWhileSending" \in Bugs THEN TRUE
                          ELSE preaders[q][p] = {} /\ ~SentFrom(q, p)
(* A finite set of integers as the ascending sequence of its elements. Not SortSeq:  *)
(* the standard module TLC, extended above, defines SortSeq(s, Op) with two arguments,   *)
(* and SANY refuses a second definition of the name. Element i is the x with exactly     *)
(* i - 1 elements of S below it, so TLC computes it directly instead of searching the    *)
(* function set [1..n -> S] (n^n candidates) in every Admit and Reserve.                 *)
Ascending(S) == [i \in 1..Cardinality(S) |->
                   CHOOSE x \in S : Cardinality({y \in S : y < x}) = i - 1]
(* Pages the prefill may allocate: owned by no request and, if cached, evictable (see   *)
(* PrefillEvictable below): allocating a cached page evicts it. Without PrefillCache no    *)
(* page is ever cached, and this is every page no request owns.                           *)
FreePrefill(q) == {p \in PPages : powner[q][p] = NoReq
                                  /\ (pident[q][p] = NoIdent \/ PrefillEvictable(q, p))}
(* Pages decode may allocate: owned by no request and read by none. With PrefixCache a   *)
(* free page may still be cached (sealed, no readers): allocating it evicts it.         *)
FreeDecode(d) == {p \in DPages : owner[d][p] = NoReq /\ readers[d][p] = {}}
WritesOf(r) == {w \in writes : w.req = r}
ClientError(r, e) == IF client[r] = "Waiting" THEN e ELSE client[r]
(* powner with r's sources at its prefill worker freed. *)
FreeSources(r) == [powner EXCEPT ![pworker[r]] =
                     [p \in PPages |-> IF p \in Range(src[r]) /\ @[p] = r THEN NoReq ELSE @[p]]]
(* Page p of prefill worker q is read by a write in flight of the request that owns it. *)
Reading(q, p) == \E w \in writes : pworker[w.req] = q /\ w.src = p /\ w.req = powner[q][p]
(* The sources of r that none of r's writes in flight still reads: all of them, unless the  *)
(* final word went out before the writes completed (EarlyDone); a completion frees the rest. *)
FreeUnreadSources(r) == [powner EXCEPT ![pworker[r]] =
                           [p \in PPages |-> IF p \in Range(src[r]) /\ @[p] = r
                                                /\ ~Reading(pworker[r], p)
                                              THEN NoReq ELSE @[p]]]
(* Decode's own count: as many of r's writes as n have landed in its pages. An IF, not a    *)
(* disjunction, so that TLC enumerates each step once (see LeaseLapsed).                    *)
Counted(r, n) == IF "NoLandedCount" \in Bugs THEN TRUE ELSE landed[r] >= n
HoldsPages(r) == dst[r] \in {"Waiting", "Decoding", "Closing"}
Overlong(r) == prompt[r] > Min(PrefillPages, DecodePages)

(* Prefix caching (PrefixCache; spec/README.md "Prefix caching"). A prompt is a sequence   *)
(* of abstract tokens, one per page, and a request carries a salt (its tenant). A page's   *)
(* content identity is <<salt, the tokens of that page and of every page before it>>: the *)
(* hash chain vLLM keys its blocks by, without the hashing (collisions are out of scope:   *)
(* the identity is the chain itself). Without PrefixCache tokens are <<>>, salts 0, and    *)
(* no page is ever cached, so every model without it has the state graph it had.         *)
PromptsOf(n) == IF PrefixCache THEN [1..n -> 1..Tokens] ELSE {<<>>}
SaltsOf == IF PrefixCache THEN 1..Tenants ELSE {0}
(* What page i of r holds: the identity of its data. *)
TrueIdent(r, i) == <<salt[r], [j \in 1..i |-> tokens[r][j]]>>
(* The key decode's cache index files page i of r under. NoSalt leaves the salt out. *)
CacheKey(r, i) == <<IF "NoSalt" \in Bugs THEN 0 ELSE salt[r], [j \in 1..i |-> tokens[r][j]]>>
Cached(d, key) == {p \in DPages : ident[d][p] = key}
(* The longest prefix of r's prompt whose every page decode has cached. *)
HitLen(r) == IF ~PrefixCache THEN 0
             ELSE CHOOSE k \in 0..prompt[r] :
                    /\ \A i \in 1..k : Cached(dworker[r], CacheKey(r, i)) # {}
                    /\ k = prompt[r] \/ Cached(dworker[r], CacheKey(r, k + 1)) = {}
(* The cached page decode references for page i of r: the lowest-numbered page filed     *)
(* under the key (two requests that missed together may both have sealed one).          *)
HitPage(r, i) == LET P == Cached(dworker[r], CacheKey(r, i))
                 IN CHOOSE p \in P : \A o \in P : p <= o
(* What decode tells the prefill it holds. StaleHitLength: a length one page too long  *)
(* (a storage hit counted before the load failed or the page went): decode believes it *)
(* and reserves a fresh page for it that nobody writes.                                 *)
ToldHit(r, k) == IF "StaleHitLength" \in Bugs /\ PrefixCache /\ k < prompt[r] THEN k + 1 ELSE k
(* The pages the prefill sends: those after the hit decode told it. *)
ToSend(r) == IF Len(src[r]) > phit[r] THEN Len(src[r]) - phit[r] ELSE 0
TablePages(r) == {table[r][i].page : i \in DOMAIN table[r]}
IndexOf(s, x) == CHOOSE i \in DOMAIN s : s[i] = x
PageIndex(r, p) == CHOOSE i \in DOMAIN table[r] : table[r][i].page = p
(* The content identity a page's tag names (issue 28): with PrefixCache, page i of r's     *)
(* prompt is tagged with r's own identity for it, and a reader expects its own (TagsMatch), *)
(* so a page reached under a wrong key (NoSalt) fails the tag check like a stale one.       *)
(* NoIdentTag: the tag names the generation only, as before caching. Decode writes the tag  *)
(* at landing from the write's request and the page's place in that request's table (it   *)
(* knows both: the bootstrap carried the tokens and salt); a page no longer in the table   *)
(* (a restarted decode's old write) is tagged with no identity.                            *)
TagIdent(r, i) == IF PrefixCache /\ "NoIdentTag" \notin Bugs THEN TrueIdent(r, i) ELSE NoIdent
WrittenIdent(w) == IF w.dst \in TablePages(w.req) THEN TagIdent(w.req, PageIndex(w.req, w.dst))
                   ELSE NoIdent
(* The identity of the KV prefill page p of worker q holds, which a write carries. *)
SourceIdent(q, p) == LET x == pdata[q][p]
                     IN IF x = NoReq \/ p \notin Range(src[x]) THEN NoIdent
                        ELSE TrueIdent(x, IndexOf(src[x], p))

(* Prefill-side caching (PrefillCache; spec/README.md "Prefill-side caching"). The prefill *)
(* keeps the pages it computed under the same content identity and key as decode         *)
(* (CacheKey, NoSalt included). At Admit it looks the prompt up: the longest prefix whose *)
(* every page it holds cached (PHitLen; none for a placeholder, FinishedNotRejected), the *)
(* lowest-numbered page for each (PHitPage). Its sources are those pages followed by the  *)
(* pages it allocates and computes for the rest.                                          *)
PCached(q, key) == {p \in PPages : pident[q][p] = key}
PHitLen(r) == IF ~PrefillCache \/ prompt[r] > PrefillPages THEN 0
              ELSE CHOOSE k \in 0..prompt[r] :
                     /\ \A i \in 1..k : PCached(pworker[r], CacheKey(r, i)) # {}
                     /\ k = prompt[r] \/ PCached(pworker[r], CacheKey(r, k + 1)) = {}
PHitPage(r, i) == LET P == PCached(pworker[r], CacheKey(r, i))
                  IN CHOOSE p \in P : \A o \in P : p <= o
(* The pages r computed that it still owns, which its SendDone seals: each was written at  *)
(* Admit (the spec computes there) and every write out of it has completed by SendDone, so *)
(* no page is findable before its KV is whole. A placeholder's page holds no prompt's KV   *)
(* and is never sealed.                                                                   *)
PSeals(r) == IF PrefillCache /\ prompt[r] <= PrefillPages
               THEN {src[r][i] : i \in pcached[r] + 1..Len(src[r])}
                      \cap {p \in PPages : powner[pworker[r]][p] = r}
               ELSE {}
(* r stops reading the cached sources it hit: they stay cached for the next request. *)
PDropReferences(r) == IF PrefillCache
                        THEN [preaders EXCEPT ![pworker[r]] = [p \in PPages |-> @[p] \ {r}]]
                        ELSE preaders

TypeOK ==
    /\ client \in [Requests -> ClientStates]
    /\ prompt \in [Requests -> 0..MaxPromptPages]
    /\ pst \in [Requests -> PrefillStates]
    /\ sent \in [Requests -> 0..MaxPromptPages]
    /\ \A r \in Requests : src[r] \in Seq(PPages) /\ Len(src[r]) <= PrefillPages
    /\ dst \in [Requests -> DecodeStates]
    /\ \A r \in Requests : Len(table[r]) <= DecodePages
    /\ boot \in [Requests -> BOOLEAN]
    /\ fwMsg \in [Requests -> Messages]
    /\ dfw \in [Requests -> BOOLEAN]
    /\ cancel \in [Requests -> BOOLEAN]
    /\ \A r \in Requests : Len(ptable[r]) <= DecodePages
    /\ fwCount \in [Requests -> 0..MaxPromptPages]
    /\ announced \in [Requests -> 0..MaxPromptPages]
    /\ landed \in [Requests -> Nat]
    /\ leaked \subseteq Requests
    /\ pworker \in [Requests -> PrefillWorkers \cup {NoWorker}]
    /\ dworker \in [Requests -> DecodeWorkers \cup {NoWorker}]
    /\ owner \in [DecodeWorkers -> [DPages -> Requests \cup {NoReq}]]
    /\ gen \in [DecodeWorkers -> [DPages -> Nat]]
    /\ \A d \in DecodeWorkers : \A p \in DPages :
          content[d][p][1] \in Requests \cup {NoReq} /\ content[d][p][2] \in Int
    /\ powner \in [PrefillWorkers -> [PPages -> Requests \cup {NoReq}]]
    /\ pdata \in [PrefillWorkers -> [PPages -> Requests \cup {NoReq}]]
    /\ \A w \in writes : w.req \in Requests /\ w.src \in PPages /\ w.dst \in DPages
    /\ \A r \in Requests : tokens[r] \in Seq(1..Tokens) /\ Len(tokens[r]) <= MaxPromptPages
    /\ salt \in [Requests -> 0..Tenants]
    /\ hit \in [Requests -> 0..MaxPromptPages]
    /\ phit \in [Requests -> 0..MaxPromptPages]
    /\ readers \in [DecodeWorkers -> [DPages -> SUBSET Requests]]
    /\ pcached \in [Requests -> 0..MaxPromptPages]
    /\ preaders \in [PrefillWorkers -> [PPages -> SUBSET Requests]]

Init ==
    /\ client = [r \in Requests |-> "Idle"]
    /\ prompt = [r \in Requests |-> 0]
    /\ pst = [r \in Requests |-> "None"]
    /\ sent = [r \in Requests |-> 0]
    /\ src = [r \in Requests |-> <<>>]
    /\ dst = [r \in Requests |-> "None"]
    /\ table = [r \in Requests |-> <<>>]
    /\ boot = [r \in Requests |-> FALSE]
    /\ fwMsg = [r \in Requests |-> "None"]
    /\ dfw = [r \in Requests |-> FALSE]
    /\ cancel = [r \in Requests |-> FALSE]
    /\ ptable = [r \in Requests |-> <<>>]
    /\ fwCount = [r \in Requests |-> 0]
    /\ announced = [r \in Requests |-> 0]
    /\ landed = [r \in Requests |-> 0]
    /\ leaked = {}
    /\ pworker = [r \in Requests |-> NoWorker]
    /\ dworker = [r \in Requests |-> NoWorker]
    /\ owner = [d \in DecodeWorkers |-> [p \in DPages |-> NoReq]]
    /\ gen = [d \in DecodeWorkers |-> [p \in DPages |-> 0]]
    /\ content = [d \in DecodeWorkers |-> [p \in DPages |-> <<NoReq, -1, NoIdent>>]]
    /\ powner = [q \in PrefillWorkers |-> [p \in PPages |-> NoReq]]
    /\ pdata = [q \in PrefillWorkers |-> [p \in PPages |-> NoReq]]
    /\ writes = {}
    /\ tokens = [r \in Requests |-> <<>>]
    /\ salt = [r \in Requests |-> 0]
    /\ hit = [r \in Requests |-> 0]
    /\ phit = [r \in Requests |-> 0]
    /\ readers = [d \in DecodeWorkers |-> [p \in DPages |-> {}]]
    /\ ident = [d \in DecodeWorkers |-> [p \in DPages |-> NoIdent]]
    /\ kv = [d \in DecodeWorkers |-> [p \in DPages |-> NoIdent]]
    /\ pcached = [r \in Requests |-> 0]
    /\ preaders = [q \in PrefillWorkers |-> [p \in PPages |-> {}]]
    /\ pident = [q \in PrefillWorkers |-> [p \in PPages |-> NoIdent]]

-----------------------------------------------------------------------------
(* Router and client. *)

(* The router admits the prompt and places it on prefill worker q and decode worker d, *)
(* any of them (every worker has room: see Advertised). A prompt it refuses is placed  *)
(* nowhere. With PrefixCache the prompt is the tokens t, and the request's salt is s.  *)
Arrive(r, n, q, d, t, s) ==
    /\ client[r] = "Idle"
    /\ prompt' = [prompt EXCEPT ![r] = n]
    /\ tokens' = [tokens EXCEPT ![r] = t]
    /\ salt' = [salt EXCEPT ![r] = s]
    /\ IF n > Advertised
         THEN /\ client' = [client EXCEPT ![r] = "ErrTooLong"]
              /\ UNCHANGED <<pst, boot, pworker, dworker>>
         ELSE /\ client' = [client EXCEPT ![r] = "Waiting"]
              /\ pst' = [pst EXCEPT ![r] = "Queued"]
              /\ boot' = [boot EXCEPT ![r] = TRUE]
              /\ pworker' = [pworker EXCEPT ![r] = q]
              /\ dworker' = [dworker EXCEPT ![r] = d]
    /\ UNCHANGED <<sent, src, dst, table, fwMsg, dfw, cancel, leaked, owner, gen, content,
                   powner, pdata, writes, ptable, fwCount, announced, landed,
                   hit, phit, readers, ident, kv, pcached, preaders, pident>>

Abort(r) ==
    /\ client[r] = "Waiting"
    /\ client' = [client EXCEPT ![r] = "Gone"]
    /\ UNCHANGED <<pworker, dworker, prompt, pst, sent, src, dst, table, boot, fwMsg, dfw, cancel, leaked,
                   owner, gen, content, powner, pdata, writes, ptable, fwCount,
                   announced, landed,
                   tokens, salt, hit, phit, readers, ident, kv, pcached, preaders, pident>>

-----------------------------------------------------------------------------
(* Prefill. *)

AdmitNeed(r) == IF prompt[r] > PrefillPages THEN 1 ELSE prompt[r]

(* The prefill admits a request (takes its source pages and computes) only once decode   *)
(* has reserved for it and published its page table: the bootstrap queue. A prefill that *)
(* took its pages first could hold its whole pool for requests whose decode pages are    *)
(* held by requests queued behind them at the prefill: a deadlock only timeouts break    *)
(* (FittingRequestsSucceed finds it with AdmitBeforeReserve).                            *)
(* With PrefillCache the prefill references the k pages it holds cached for the prompt's  *)
(* first pages (becomes one of their readers) and allocates and computes S only for the   *)
(* rest; a full hit (k = n) computes nothing and still sends what decode lacks.          *)
Admit(r, S) ==
    /\ pst[r] = "Queued"
    /\ ptable[r] # <<>> \/ "AdmitBeforeReserve" \in Bugs
    /\ prompt[r] <= PrefillPages \/ "FinishedNotRejected" \in Bugs
    /\ S \subseteq FreePrefill(pworker[r])
    /\ Cardinality(S) = AdmitNeed(r) - PHitLen(r)
    /\ \A i \in 1..PHitLen(r) : PHitPage(r, i) \notin S
    /\ LET k == PHitLen(r)
           h == [i \in 1..k |-> PHitPage(r, i)]
           a == Ascending(S)
       IN /\ src' = [src EXCEPT ![r] = [i \in 1..k + Cardinality(S) |->
                                           IF i <= k THEN h[i] ELSE a[i - k]]]
          /\ pcached' = [pcached EXCEPT ![r] = k]
          /\ preaders' = IF PrefillCache
                            THEN [preaders EXCEPT ![pworker[r]] =
                                    [p \in PPages |-> IF p \in Range(h) THEN @[p] \cup {r}
                                                      ELSE @[p]]]
                            ELSE preaders
          /\ pident' = IF PrefillCache
                          THEN [pident EXCEPT ![pworker[r]] =
                                  [p \in PPages |-> IF p \in S THEN NoIdent ELSE @[p]]]
                          ELSE pident
    /\ pst' = [pst EXCEPT ![r] = "Running"]
    /\ powner' = [powner EXCEPT ![pworker[r]] = [p \in PPages |-> IF p \in S THEN r ELSE @[p]]]
    /\ pdata' = [pdata EXCEPT ![pworker[r]] = [p \in PPages |-> IF p \in S THEN r ELSE @[p]]]
    /\ UNCHANGED <<pworker, dworker, client, prompt, sent, dst, table, boot, fwMsg, dfw, cancel, leaked,
                   owner, gen, content, writes, ptable, fwCount, announced,
                   landed,
                   tokens, salt, hit, phit, readers, ident, kv>>

Reject(r) ==
    /\ pst[r] = "Queued"
    /\ prompt[r] > PrefillPages
    /\ "FinishedNotRejected" \notin Bugs
    /\ pst' = [pst EXCEPT ![r] = "Rejected"]
    /\ fwMsg' = [fwMsg EXCEPT ![r] = "Reject"]
    /\ fwCount' = [fwCount EXCEPT ![r] = sent[r]]
    /\ client' = [client EXCEPT ![r] = ClientError(r, "ErrTooLong")]
    /\ UNCHANGED <<pworker, dworker, prompt, sent, src, dst, table, boot, dfw, cancel, leaked, owner, gen,
                   content, powner, pdata, writes, ptable, announced, landed,
                   tokens, salt, hit, phit, readers, ident, kv, pcached, preaders, pident>>

(* The prefill sends only the pages after the hit decode told it (phit), page i of its   *)
(* sources into entry i of decode's table: the tail, into the right pages.                *)
SendPage(r) ==
    /\ pst[r] = "Running"
    /\ ptable[r] # <<>>
    /\ sent[r] < ToSend(r)
    /\ LET i == phit[r] + sent[r] + 1
       IN /\ writes' = writes \cup {[req |-> r, src |-> src[r][i],
                                     dst |-> ptable[r][i].page, gen |-> ptable[r][i].gen]}
          /\ sent' = [sent EXCEPT ![r] = sent[r] + 1]
          /\ powner' = IF i = Len(src[r]) /\ "SourceReuse" \in Bugs
                         THEN FreeSources(r) ELSE powner
    /\ UNCHANGED <<pworker, dworker, client, prompt, pst, src, dst, table, boot, fwMsg, dfw, cancel, leaked,
                   owner, gen, content, pdata, ptable, fwCount, announced, landed,
                   tokens, salt, hit, phit, readers, ident, kv, pcached, preaders, pident>>

LandWrite(w) ==
    /\ w \in writes
    /\ content' = [content EXCEPT ![dworker[w.req]][w.dst] =
                     <<pdata[pworker[w.req]][w.src], w.gen, WrittenIdent(w)>>]
    /\ kv' = IF PrefixCache
              THEN [kv EXCEPT ![dworker[w.req]][w.dst] = SourceIdent(pworker[w.req], w.src)]
              ELSE kv
    /\ writes' = writes \ {w}
    /\ landed' = [landed EXCEPT ![w.req] = landed[w.req] + 1]
    /\ powner' = IF pst[w.req] # "Running" /\ powner[pworker[w.req]][w.src] = w.req
                   THEN [powner EXCEPT ![pworker[w.req]][w.src] = NoReq] ELSE powner
    /\ UNCHANGED <<pworker, dworker, client, prompt, pst, sent, src, dst, table, boot, fwMsg, dfw, cancel,
                   leaked, owner, gen, pdata, ptable, fwCount, announced,
                   tokens, salt, hit, phit, readers, ident, pcached, preaders, pident>>

(* With PrefillCache the prefill seals the pages r computed (PSeals: see there why here)  *)
(* and r stops reading the cached sources it hit; they stay cached.                      *)
SendDone(r) ==
    /\ pst[r] = "Running"
    /\ sent[r] = ToSend(r)
    /\ IF "EarlyDone" \in Bugs THEN TRUE ELSE WritesOf(r) = {}
    /\ pst' = [pst EXCEPT ![r] = "Done"]
    /\ fwMsg' = [fwMsg EXCEPT ![r] = "Done"]
    /\ fwCount' = [fwCount EXCEPT ![r] = sent[r]]
    /\ powner' = [FreeUnreadSources(r) EXCEPT ![pworker[r]] =
                    [p \in PPages |-> IF p \in PSeals(r) THEN NoReq ELSE @[p]]]
    /\ pident' = IF PrefillCache
                    THEN [pident EXCEPT ![pworker[r]] =
                            [p \in PPages |-> IF p \in PSeals(r)
                                              THEN CacheKey(r, IndexOf(src[r], p)) ELSE @[p]]]
                    ELSE pident
    /\ preaders' = PDropReferences(r)
    /\ UNCHANGED <<pworker, dworker, client, prompt, sent, src, dst, table, boot, dfw, cancel, leaked,
                   owner, gen, content, pdata, writes, ptable, announced, landed,
                   tokens, salt, hit, phit, readers, ident, kv, pcached>>

(* A prefill that stops because of a cancel answers it; NoAbortNotice drops only the   *)
(* notice a prefill owes decode when it stops on its own or on a client abort.         *)
StopPrefill(r, c) ==
    /\ pst' = [pst EXCEPT ![r] = "Aborted"]
    /\ cancel' = [cancel EXCEPT ![r] = FALSE]
    /\ fwMsg' = IF "NoAbortNotice" \in Bugs /\ ~cancel[r]
                  THEN fwMsg ELSE [fwMsg EXCEPT ![r] = "Abort"]
    /\ fwCount' = IF "NoAbortNotice" \in Bugs /\ ~cancel[r]
                    THEN fwCount ELSE [fwCount EXCEPT ![r] = sent[r]]
    /\ client' = [client EXCEPT ![r] = c]
    /\ powner' = FreeSources(r)
    /\ preaders' = PDropReferences(r)
    /\ UNCHANGED <<pworker, dworker, prompt, sent, src, dst, table, boot, dfw, leaked, owner, gen, content,
                   pdata, writes, ptable, announced, landed,
                   tokens, salt, hit, phit, readers, ident, kv, pcached, pident>>

PrefillCanStop(r) == pst[r] \in {"Queued", "Running"} /\ WritesOf(r) = {}

PrefillAbort(r) ==
    /\ PrefillCanStop(r)
    /\ cancel[r] \/ client[r] = "Gone"
    /\ StopPrefill(r, client[r])

PrefillFail(r) ==
    /\ PrefillCanStop(r)
    /\ client[r] = "Waiting"
    /\ StopPrefill(r, "ErrPrefill")

(* The prefill dies and restarts empty. Its queued and running requests are lost (their  *)
(* clients see an error), its pool is free again (its cache index and every reference    *)
(* with it: PrefillCache), and the writes it had posted are                              *)
(* flushed with its queue pairs. It sends no notice: decode learns by timing out, and the *)
(* restarted prefill answers the cancel with Abort. Cancels in flight reach the restarted *)
(* prefill (decode re-sends outstanding cancels when the prefill reconnects).             *)
Active(r) == pst[r] \in {"Queued", "Running"}

(* A crash also fails the writes of a request that already sent its final word (EarlyDone): *)
(* it loses something then too. An IF, not a disjunction: the same ways as Active alone     *)
(* where writes drain before the final word.                                               *)
PrefillLoses(r) == IF Active(r) THEN TRUE ELSE WritesOf(r) # {}

(* Prefill worker q crashes: only its requests, its pool and its writes are touched. *)
PrefillCrash(q) ==
    /\ Crashes
    /\ \E r \in Requests : pworker[r] = q /\ PrefillLoses(r)
    /\ pst' = [r \in Requests |-> IF pworker[r] = q /\ Active(r) THEN "Aborted" ELSE pst[r]]
    /\ client' = [r \in Requests |-> IF pworker[r] = q /\ Active(r)
                                      THEN ClientError(r, "ErrPrefill") ELSE client[r]]
    /\ sent' = [r \in Requests |-> IF pworker[r] = q /\ Active(r) THEN 0 ELSE sent[r]]
    /\ powner' = [powner EXCEPT ![q] = [p \in PPages |-> NoReq]]
    /\ writes' = {w \in writes : pworker[w.req] # q}
    /\ preaders' = IF PrefillCache THEN [preaders EXCEPT ![q] = [p \in PPages |-> {}]]
                                   ELSE preaders
    /\ pident' = IF PrefillCache THEN [pident EXCEPT ![q] = [p \in PPages |-> NoIdent]]
                                 ELSE pident
    /\ UNCHANGED <<pworker, dworker, prompt, src, dst, table, boot, fwMsg, dfw, cancel, leaked, owner, gen,
                   content, pdata, ptable, fwCount, announced, landed,
                   tokens, salt, hit, phit, readers, ident, kv, pcached>>

(* A decode worker d dies and restarts empty, in a new epoch of its own. Every request it knew of, or had a  *)
(* bootstrap for in flight, is lost: its client sees an error and decode keeps it as a    *)
(* tombstone (the restarted decode drops every message of the old epoch, so a late        *)
(* bootstrap never reserves again). Its pool is free again, but generations survive the   *)
(* restart, so no stale tag can look current. Writes in flight into the old memory        *)
(* registration fail and are flushed; the prefill learns from the broken connection       *)
(* (modelled as a cancel; see CrashNotice) and stops or repeats its final word, which      *)
(* decode ignores.                                                                         *)
(*                                                                                        *)
(* Two bug switches break the restart. GenerationReset: the restarted decode issues        *)
(* generations from zero again (its tag counter died with the process), so a stale page's *)
(* tag can equal the one a new reservation issues. NoEpochCheck: the restarted decode      *)
(* takes a bootstrap of the old epoch as new (it has forgotten the request, tombstone and  *)
(* final word included) and reserves for a request its old life already ended. A crash    *)
(* also fails the writes in flight, and the prefill frees the sources of a request it has *)
(* stopped running as their failed completions come back (with EarlyDone there are such). *)
DecodeKnows(r) == boot[r] \/ HoldsPages(r)
Revived(r) == "NoEpochCheck" \in Bugs /\ boot[r]
(* What the crash takes from r: everything decode knew of it; for a revived bootstrap its *)
(* tombstone, the prefill's connection (a cancel) or the client's wait (a crash that takes *)
(* nothing is no step).                                                                   *)
Loses(r) == IF Revived(r) THEN dst[r] = "Tomb" \/ Active(r) /\ ~cancel[r]
                                \/ client[r] = "Waiting"
                           ELSE DecodeKnows(r)

(* Only d's requests (KnownAt, RevivedAt), pool and the writes into it are touched.     *)
KnownAt(d, r) == dworker[r] = d /\ DecodeKnows(r)
RevivedAt(d, r) == dworker[r] = d /\ Revived(r)

DecodeCrash(d) ==
    /\ DecodeCrashes
    /\ \E r \in Requests : dworker[r] = d /\ Loses(r)
    /\ dst' = [r \in Requests |-> IF RevivedAt(d, r) THEN "None"
                                  ELSE IF KnownAt(d, r) THEN "Tomb" ELSE dst[r]]
    /\ boot' = [r \in Requests |-> IF KnownAt(d, r) /\ ~Revived(r) THEN FALSE ELSE boot[r]]
    /\ dfw' = [r \in Requests |-> IF RevivedAt(d, r) THEN FALSE ELSE dfw[r]]
    /\ announced' = [r \in Requests |-> IF RevivedAt(d, r) THEN 0 ELSE announced[r]]
    /\ table' = [r \in Requests |-> IF KnownAt(d, r) THEN <<>> ELSE table[r]]
    /\ ptable' = [r \in Requests |-> IF KnownAt(d, r) THEN <<>> ELSE ptable[r]]
    /\ cancel' = [r \in Requests |-> IF KnownAt(d, r) /\ Active(r) THEN TRUE ELSE cancel[r]]
    /\ client' = [r \in Requests |-> IF KnownAt(d, r) THEN ClientError(r, "ErrDecode")
                                                      ELSE client[r]]
    /\ owner' = [owner EXCEPT ![d] = [p \in DPages |-> NoReq]]
    /\ gen' = IF "GenerationReset" \in Bugs THEN [gen EXCEPT ![d] = [p \in DPages |-> 0]]
                                             ELSE gen
    /\ powner' = [q \in PrefillWorkers |->
                    [p \in PPages |-> IF Reading(q, p) /\ dworker[powner[q][p]] = d
                                         /\ ~Active(powner[q][p])
                                      THEN NoReq ELSE powner[q][p]]]
    /\ writes' = {w \in writes : dworker[w.req] # d}
    /\ readers' = IF PrefixCache THEN [readers EXCEPT ![d] = [p \in DPages |-> {}]] ELSE readers
    /\ ident' = IF PrefixCache THEN [ident EXCEPT ![d] = [p \in DPages |-> NoIdent]] ELSE ident
    /\ UNCHANGED <<pworker, dworker, prompt, pst, sent, src, fwMsg, leaked, content, pdata, fwCount,
                   landed,
                   tokens, salt, hit, phit, kv, pcached, preaders, pident>>

FinalWordOf(s) == CASE s = "Done" -> "Done"
                    [] s = "Rejected" -> "Reject"
                    [] s = "Aborted" -> "Abort"

AnswerCancel(r) ==
    /\ cancel[r]
    /\ pst[r] \in {"Done", "Rejected", "Aborted"}
    /\ cancel' = [cancel EXCEPT ![r] = FALSE]
    /\ fwMsg' = [fwMsg EXCEPT ![r] = FinalWordOf(pst[r])]
    /\ fwCount' = [fwCount EXCEPT ![r] = sent[r]]
    /\ UNCHANGED <<pworker, dworker, client, prompt, pst, sent, src, dst, table, boot, dfw, leaked, owner,
                   gen, content, powner, pdata, writes, ptable, announced, landed,
                   tokens, salt, hit, phit, readers, ident, kv, pcached, preaders, pident>>

-----------------------------------------------------------------------------
(* Decode. *)

(* Decode takes the bootstrap. With PrefixCache it first looks the prompt up: it holds   *)
(* the first k pages cached (HitLen), references them (it becomes one of their readers) and *)
(* reserves fresh pages S only for the n - k it lacks; it tells the prefill k with the     *)
(* page table, whose first k entries are the cached pages. A full hit (k = n) still         *)
(* publishes the table: the prefill computes (it samples the first token), sends nothing   *)
(* and says Done, so its final word flows and nothing of it is stranded. FullHitNoNotice:  *)
(* on a full hit decode decodes at once and tells the prefill nothing.                    *)
Reserve(r, S) ==
    /\ boot[r]
    /\ dst[r] = "None"
    /\ prompt[r] <= DecodePages
    /\ S \subseteq FreeDecode(dworker[r])
    /\ Cardinality(S) = prompt[r] - HitLen(r)
    /\ \A i \in 1..HitLen(r) : HitPage(r, i) \notin S
    /\ LET k == HitLen(r)
           h == [i \in 1..k |-> HitPage(r, i)]
           g == [p \in DPages |-> IF p \in S /\ "NoGenBump" \notin Bugs
                                    THEN gen[dworker[r]][p] + 1 ELSE gen[dworker[r]][p]]
           q == Ascending(S)
           t == [i \in 1..prompt[r] |-> IF i <= k THEN [page |-> h[i], gen |-> g[h[i]]]
                                                ELSE [page |-> q[i - k], gen |-> g[q[i - k]]]]
           silent == k = prompt[r] /\ "FullHitNoNotice" \in Bugs
       IN /\ gen' = [gen EXCEPT ![dworker[r]] = g]
          /\ table' = [table EXCEPT ![r] = t]
          /\ hit' = [hit EXCEPT ![r] = ToldHit(r, k)]
          /\ owner' = [owner EXCEPT ![dworker[r]] =
                         [p \in DPages |-> IF p \in S THEN r ELSE @[p]]]
          /\ readers' = [readers EXCEPT ![dworker[r]] =
                           [p \in DPages |-> IF p \in Range(h) THEN @[p] \cup {r} ELSE @[p]]]
          /\ ident' = [ident EXCEPT ![dworker[r]] =
                         [p \in DPages |-> IF p \in S THEN NoIdent ELSE @[p]]]
          /\ IF silent
               THEN /\ dst' = [dst EXCEPT ![r] = "Decoding"]
                    /\ dfw' = [dfw EXCEPT ![r] = TRUE]
                    /\ UNCHANGED <<ptable, phit>>
               ELSE /\ dst' = [dst EXCEPT ![r] = "Waiting"]
                    /\ ptable' = [ptable EXCEPT ![r] = t]
                    /\ phit' = [phit EXCEPT ![r] = ToldHit(r, k)]
                    /\ UNCHANGED dfw
    /\ boot' = [boot EXCEPT ![r] = FALSE]
    /\ UNCHANGED <<pworker, dworker, client, prompt, pst, sent, src, fwMsg, cancel, leaked, content,
                   powner, pdata, writes, fwCount, announced, landed,
                   tokens, salt, kv, pcached, preaders, pident>>

DecodeReject(r) ==
    /\ boot[r]
    /\ dst[r] = "None"
    /\ prompt[r] > DecodePages
    /\ boot' = [boot EXCEPT ![r] = FALSE]
    /\ dst' = [dst EXCEPT ![r] = "Closing"]
    /\ cancel' = IF "NoCancel" \in Bugs THEN cancel ELSE [cancel EXCEPT ![r] = TRUE]
    /\ client' = [client EXCEPT ![r] = ClientError(r, "ErrTooLong")]
    /\ UNCHANGED <<pworker, dworker, prompt, pst, sent, src, table, fwMsg, dfw, leaked, owner, gen, content,
                   powner, pdata, writes, ptable, fwCount, announced, landed,
                   tokens, salt, hit, phit, readers, ident, kv, pcached, preaders, pident>>

DropBootstrap(r) ==
    /\ boot[r]
    /\ dst[r] = "Tomb"
    /\ boot' = [boot EXCEPT ![r] = FALSE]
    /\ UNCHANGED <<pworker, dworker, client, prompt, pst, sent, src, dst, table, fwMsg, dfw, cancel, leaked,
                   owner, gen, content, powner, pdata, writes, ptable, fwCount,
                   announced, landed,
                   tokens, salt, hit, phit, readers, ident, kv, pcached, preaders, pident>>

(* What decode answers a waiting client on a Reject or an Abort. A Reject's is the       *)
(* prefill's own answer (a prefill rejects only a prompt too long for its pool), so the   *)
(* client's answer is the same whichever of the two reaches the serving edge first: a     *)
(* real edge hears them over two connections, in either order (with ErrPrefill here a     *)
(* deployment answered ErrPrefill where this spec's run said ErrTooLong).                 *)
WordAnswer(m) == IF m = "Reject" THEN "ErrTooLong" ELSE "ErrPrefill"

(* Decode's handling of a final word it cannot accept as a transfer. *)
(* Decode keeps the final word and the count of writes it announces.                  *)
ReceiveFinalWord(r) ==
    /\ fwMsg' = [fwMsg EXCEPT ![r] = "None"]
    /\ fwCount' = [fwCount EXCEPT ![r] = 0]
    /\ CASE dst[r] = "None" ->
              IF "NoTombstone" \in Bugs
                THEN UNCHANGED <<dst, dfw, announced, client>>
                ELSE /\ dst' = [dst EXCEPT ![r] = "Tomb"]
                     /\ dfw' = [dfw EXCEPT ![r] = TRUE]
                     /\ announced' = [announced EXCEPT ![r] = fwCount[r]]
                     /\ UNCHANGED client
         [] dst[r] = "Waiting" ->
              /\ dst' = [dst EXCEPT ![r] = "Closing"]
              /\ dfw' = [dfw EXCEPT ![r] = TRUE]
              /\ announced' = [announced EXCEPT ![r] = fwCount[r]]
              /\ client' = [client EXCEPT ![r] = ClientError(r, WordAnswer(fwMsg[r]))]
         [] dst[r] = "Closing" ->
              /\ dfw' = [dfw EXCEPT ![r] = TRUE]
              /\ announced' = [announced EXCEPT ![r] = fwCount[r]]
              /\ UNCHANGED <<dst, client>>
         [] OTHER -> UNCHANGED <<dst, dfw, announced, client>>

(* Observed verdicts. Whether the checksums of the landed pages match, and whether every   *)
(* page's tag is the one decode reserved, is known only to the data path: a real engine     *)
(* computes a digest and compares tags in its attention kernel. So Accept and Finish take   *)
(* the data path's observation as an argument and decide on it alone. In this spec the      *)
(* data path is modelled by the abstract page contents: Next passes the observation those    *)
(* contents imply (ChecksumsMatch, TagsMatch), which is also the oracle a shell's reported   *)
(* observation is compared with (spec/core.py observation_conflict).                        *)
(* The pages sent are the entries after the hit decode believes it holds.              *)
(* With PrefixCache the checksum compares content identities (what the sender's digest   *)
(* covers), not who computed the page: with PrefillCache a page sent may come from a      *)
(* cached source another request computed. (Without a prefill cache r's sources are its  *)
(* own, and the two agree.)                                                              *)
ChecksumsMatch(r) == \A i \in 1..Min(sent[r], Len(table[r]) - hit[r]) :
                         IF PrefixCache
                           THEN kv[dworker[r]][table[r][hit[r] + i].page] = TrueIdent(r, hit[r] + i)
                           ELSE content[dworker[r]][table[r][hit[r] + i].page][1] = r

TagsMatch(r) == \A i \in DOMAIN table[r] :
                    /\ content[dworker[r]][table[r][i].page][2] = table[r][i].gen
                    /\ content[dworker[r]][table[r][i].page][3] = TagIdent(r, i)

TransferFault(r, checksumsOk) ==
    \/ "NoCountCheck" \notin Bugs /\ fwCount[r] # Len(table[r]) - hit[r]
    \/ "NoChecksum" \notin Bugs /\ ~checksumsOk

(* With PrefixCache, an accepted transfer seals the pages it wrote: decode files each     *)
(* under its content identity, and the request becomes their first reader (it no longer   *)
(* owns them alone: another request with the same salt and prefix may read them now).     *)
SealedBy(r) == {table[r][i].page : i \in hit[r] + 1..Len(table[r])}

Seal(r) ==
    IF PrefixCache
      THEN /\ owner' = [owner EXCEPT ![dworker[r]] =
                          [p \in DPages |-> IF p \in SealedBy(r) THEN NoReq ELSE @[p]]]
           /\ readers' = [readers EXCEPT ![dworker[r]] =
                            [p \in DPages |-> IF p \in SealedBy(r) THEN {r} ELSE @[p]]]
           /\ ident' = [ident EXCEPT ![dworker[r]] =
                          [p \in DPages |-> IF p \in SealedBy(r)
                                            THEN CacheKey(r, PageIndex(r, p)) ELSE @[p]]]
      ELSE UNCHANGED <<owner, readers, ident>>

Accept(r, checksumsOk) ==
    /\ fwMsg[r] = "Done"
    /\ IF dst[r] = "Waiting"
         THEN /\ Counted(r, fwCount[r])
              /\ fwMsg' = [fwMsg EXCEPT ![r] = "None"]
              /\ fwCount' = [fwCount EXCEPT ![r] = 0]
              /\ dfw' = [dfw EXCEPT ![r] = TRUE]
              /\ announced' = [announced EXCEPT ![r] = fwCount[r]]
              /\ IF TransferFault(r, checksumsOk)
                   THEN /\ dst' = [dst EXCEPT ![r] = "Closing"]
                        /\ client' = [client EXCEPT ![r] = ClientError(r, "ErrTransfer")]
                        /\ UNCHANGED <<owner, readers, ident>>
                   ELSE /\ dst' = [dst EXCEPT ![r] = "Decoding"]
                        /\ UNCHANGED client
                        /\ Seal(r)
         ELSE /\ ReceiveFinalWord(r)
              /\ UNCHANGED <<owner, readers, ident>>
    /\ UNCHANGED <<pworker, dworker, prompt, pst, sent, src, table, boot, cancel, leaked, gen,
                   content, powner, pdata, writes, ptable, landed,
                   tokens, salt, hit, phit, kv, pcached, preaders, pident>>

Notice(r) ==
    /\ fwMsg[r] \in {"Reject", "Abort"}
    /\ ReceiveFinalWord(r)
    /\ UNCHANGED <<pworker, dworker, prompt, pst, sent, src, table, boot, cancel, leaked, owner, gen,
                   content, powner, pdata, writes, ptable, landed,
                   tokens, salt, hit, phit, readers, ident, kv, pcached, preaders, pident>>

(* Whether r read what is not its own: without PrefixCache, a page whose content is not  *)
(* r's at the page's current generation; with it, a page whose memory does not hold the  *)
(* content identity r's own tokens and salt imply (content, not ownership: a shared page  *)
(* was written by another request).                                                      *)
Foreign(r) == \E i \in DOMAIN table[r] :
                  LET p == table[r][i].page
                  IN IF PrefixCache
                       THEN kv[dworker[r]][p] # TrueIdent(r, i)
                       ELSE <<content[dworker[r]][p][1], content[dworker[r]][p][2]>>
                              # <<r, gen[dworker[r]][p]>>

(* The last decode step: read every page, checking its tag, and answer the client. The    *)
(* tag check is the data path's observation tagsOk; leaked is history, for the properties.  *)
Finish(r, tagsOk) ==
    /\ dst[r] = "Decoding"
    /\ dst' = [dst EXCEPT ![r] = "Closing"]
    /\ IF ~tagsOk
         THEN /\ client' = [client EXCEPT ![r] = ClientError(r, "ErrTag")]
              /\ UNCHANGED leaked
         ELSE /\ client' = [client EXCEPT ![r] = ClientError(r, "Ok")]
              /\ leaked' = IF Foreign(r) THEN leaked \cup {r} ELSE leaked
    /\ UNCHANGED <<pworker, dworker, prompt, pst, sent, src, table, boot, fwMsg, dfw, cancel, owner, gen,
                   content, powner, pdata, writes, ptable, fwCount, announced,
                   landed,
                   tokens, salt, hit, phit, readers, ident, kv, pcached, preaders, pident>>

DecodeAbort(r) ==
    /\ client[r] = "Gone"
    /\ dst[r] \in {"Waiting", "Decoding"}
    /\ dst' = [dst EXCEPT ![r] = "Closing"]
    /\ cancel' = IF dfw[r] \/ "NoCancel" \in Bugs THEN cancel ELSE [cancel EXCEPT ![r] = TRUE]
    /\ UNCHANGED <<pworker, dworker, client, prompt, pst, sent, src, table, boot, fwMsg, dfw, leaked, owner,
                   gen, content, powner, pdata, writes, ptable, fwCount, announced,
                   landed,
                   tokens, salt, hit, phit, readers, ident, kv, pcached, preaders, pident>>

(* Decode's transfer deadline is a lease: every sign of progress from the prefill on the   *)
(* request (admitted, a chunk computed, a page posted; while it is queued, the prefill's   *)
(* progress on the requests ahead of it) renews it, and it lapses only after a silence of *)
(* lease_s. In an untimed spec a renewal cannot hold a timer back, so what the lease      *)
(* changes is *when* the timer may fire: only once the prefill has gone silent on the      *)
(* request, that is, it no longer works on it (it ended or crashed) and neither its final  *)
(* word nor a write of the request is on the way. That is the synchrony assumption a      *)
(* lease rests on (a working prefill renews within lease_s), the environment's, not a     *)
(* guard decode evaluates: decode only sees its clock (spec/tlaplus/locality.py keeps     *)
(* LeaseLapsed out of decode's reads). EarlyTimeouts drops the assumption (a lease shorter *)
(* than a chunk, a paused process, a renewal late on the wire): the timer may then fire    *)
(* whenever decode waits, safety must still hold, and ErrTimeout is a fault outcome. The  *)
(* StopwatchTimeout switch is the deadline that runs from reservation whatever the        *)
(* prefill does: it fires while the prefill is queued or computing, and                  *)
(* FittingRequestsSucceed, where timers are timely, catches it.                           *)
PrefillSilent(r) == /\ pst[r] \notin {"Queued", "Running"}
                    /\ fwMsg[r] = "None"
                    /\ WritesOf(r) = {}

(* An IF, not a disjunction: TLC enumerates every true disjunct of an action as a successor *)
(* of its own, and the models where timers fire early would count each Timeout twice.     *)
LeaseLapsed(r) == IF EarlyTimeouts \/ "StopwatchTimeout" \in Bugs THEN TRUE
                                                              ELSE PrefillSilent(r)

Timeout(r) ==
    /\ "NoTimeout" \notin Bugs
    /\ dst[r] = "Waiting"
    /\ LeaseLapsed(r)
    /\ dst' = [dst EXCEPT ![r] = "Closing"]
    /\ cancel' = IF "NoCancel" \in Bugs THEN cancel ELSE [cancel EXCEPT ![r] = TRUE]
    /\ client' = [client EXCEPT ![r] = ClientError(r, "ErrTimeout")]
    /\ UNCHANGED <<pworker, dworker, prompt, pst, sent, src, table, boot, fwMsg, dfw, leaked, owner, gen,
                   content, powner, pdata, writes, ptable, fwCount, announced,
                   landed,
                   tokens, salt, hit, phit, readers, ident, kv, pcached, preaders, pident>>

(* Decode frees a request's pages once it holds the prefill's final word and has seen as *)
(* many of the request's writes land as that word announced: then none of them can still *)
(* land in the pages. Decode counts landed writes itself (landed); the writes in flight   *)
(* are the prefill's send queue, which decode cannot see.                                 *)
(* Decode's pool with the pages of r's table that r still owns free again. *)
FreedPages(r) == [owner EXCEPT ![dworker[r]] =
                    [p \in DPages |-> IF @[p] = r /\ p \in {table[r][i].page : i \in DOMAIN table[r]}
                                      THEN NoReq ELSE @[p]]]

(* With PrefixCache, r stops reading the cached pages of its table: it leaves their        *)
(* readers, and the pages stay cached (sealed) for the next request with their prefix,    *)
(* until an eviction. NoRefCount: pages are deduplicated by content key with no count of  *)
(* their readers, so the release frees them (uncached, nobody reading) however many other *)
(* requests still read them.                                                              *)
DropReferences(r) ==
    IF PrefixCache
      THEN LET mine == {p \in TablePages(r) : r \in readers[dworker[r]][p]}
           IN /\ readers' = [readers EXCEPT ![dworker[r]] =
                               [p \in DPages |-> IF p \notin mine THEN @[p]
                                                 ELSE IF "NoRefCount" \in Bugs THEN {}
                                                 ELSE @[p] \ {r}]]
              /\ ident' = IF "NoRefCount" \in Bugs
                            THEN [ident EXCEPT ![dworker[r]] =
                                    [p \in DPages |-> IF p \in mine THEN NoIdent ELSE @[p]]]
                            ELSE ident
      ELSE UNCHANGED <<readers, ident>>

Release(r) ==
    /\ dst[r] = "Closing"
    /\ \/ "EagerRelease" \in Bugs
       \/ dfw[r] /\ Counted(r, announced[r])
    /\ dst' = [dst EXCEPT ![r] = "Released"]
    /\ owner' = FreedPages(r)
    /\ DropReferences(r)
    /\ UNCHANGED <<pworker, dworker, client, prompt, pst, sent, src, table, boot, fwMsg, dfw, cancel,
                   leaked, gen, content, powner, pdata, writes, ptable, fwCount,
                   announced, landed,
                   tokens, salt, hit, phit, kv, pcached, preaders, pident>>

(* Decode forgets a cached page: any sealed page no request reads. Which one it picks     *)
(* (least recently used, ...) is an implementation's policy: the spec allows every choice, *)
(* so every policy's behaviours are behaviours of the spec, and the properties hold for    *)
(* all of them. No write is pending into a sealed page (it was sealed once the writes into *)
(* it were counted and accepted; NoEvictInUse checks it), and a page a request still       *)
(* writes is owned, not sealed. Not fair: a cache need not evict (an allocation evicts     *)
(* what it needs, see FreeDecode). The cache index forgets; the memory keeps its KV.      *)
Evict(d, p) ==
    /\ ident[d][p] # NoIdent
    /\ readers[d][p] = {}
    /\ ident' = [ident EXCEPT ![d][p] = NoIdent]
    /\ UNCHANGED <<pworker, dworker, client, prompt, pst, sent, src, dst, table, boot, fwMsg, dfw,
                   cancel, leaked, owner, gen, content, powner, pdata, writes, ptable, fwCount,
                   announced, landed, tokens, salt, hit, phit, readers, kv, pcached, preaders, pident>>

(* The prefill forgets a cached page of its own (PrefillCache): any sealed page that is    *)
(* evictable, no request reading it and no write in flight out of it (PrefillEvictable;    *)
(* EvictWhileSending ignores both). As on decode, which page a real cache picks (LRU, ...) *)
(* is its policy: the spec allows any eligible page, so every policy's behaviours are the  *)
(* spec's. Not fair; the memory keeps its KV.                                             *)
PrefillEvict(q, p) ==
    /\ pident[q][p] # NoIdent
    /\ PrefillEvictable(q, p)
    /\ pident' = [pident EXCEPT ![q][p] = NoIdent]
    /\ UNCHANGED <<pworker, dworker, client, prompt, pst, sent, src, dst, table, boot, fwMsg, dfw,
                   cancel, leaked, owner, gen, content, powner, pdata, writes, ptable, fwCount,
                   announced, landed, tokens, salt, hit, phit, readers, ident, kv, pcached,
                   preaders>>

-----------------------------------------------------------------------------
(* A network that loses things for good (Losses; none in the shipped models but the lossy  *)
(* ones). A bootstrap, a final word or a cancel vanishes on the wire. A page write vanishes *)
(* and its poster is told it completed (an unreliable transport's completion says only    *)
(* that it was sent; so does a post that failed silently): it leaves the send queue        *)
(* without landing. A loss the poster is told of is no event here: it posts again, which   *)
(* is a late LandWrite (or SendPage), and the fairness of those steps is the assumption    *)
(* that it does not fail for ever. Faults, not fair: nothing makes the network lose.       *)
LoseBootstrap(r) ==
    /\ "Bootstrap" \in Losses
    /\ boot[r]
    /\ boot' = [boot EXCEPT ![r] = FALSE]
    /\ UNCHANGED <<pworker, dworker, client, prompt, pst, sent, src, dst, table, fwMsg, dfw, cancel, leaked,
                   owner, gen, content, powner, pdata, writes, ptable, fwCount,
                   announced, landed,
                   tokens, salt, hit, phit, readers, ident, kv, pcached, preaders, pident>>

LoseFinalWord(r) ==
    /\ "FinalWord" \in Losses
    /\ fwMsg[r] # "None"
    /\ fwMsg' = [fwMsg EXCEPT ![r] = "None"]
    /\ fwCount' = [fwCount EXCEPT ![r] = 0]
    /\ UNCHANGED <<pworker, dworker, client, prompt, pst, sent, src, dst, table, boot, dfw, cancel, leaked,
                   owner, gen, content, powner, pdata, writes, ptable, announced, landed,
                   tokens, salt, hit, phit, readers, ident, kv, pcached, preaders, pident>>

(* The cancel a decode crash stands for is no message on the wire: the prefill's own       *)
(* failure detector (its transport's broken connection, a lapsed heartbeat) tells it, and   *)
(* a detector fires on the prefill's side however much the network loses. Decode itself    *)
(* sends no cancel for a tombstone, so a cancel in flight at a tombstone is that notice (a  *)
(* cancel decode sent before the crash is overtaken by it). NoFailureDetector: the prefill *)
(* learns of the crash only from a message, which the network may lose.                   *)
CrashNotice(r) == dst[r] = "Tomb" /\ "NoFailureDetector" \notin Bugs

LoseCancel(r) ==
    /\ "Cancel" \in Losses
    /\ cancel[r]
    /\ ~CrashNotice(r)
    /\ cancel' = [cancel EXCEPT ![r] = FALSE]
    /\ UNCHANGED <<pworker, dworker, client, prompt, pst, sent, src, dst, table, boot, fwMsg, dfw, leaked,
                   owner, gen, content, powner, pdata, writes, ptable, fwCount,
                   announced, landed,
                   tokens, salt, hit, phit, readers, ident, kv, pcached, preaders, pident>>

(* Its false completion frees a source the prefill kept for it, as a landing's does.       *)
LoseWrite(w) ==
    /\ "Write" \in Losses
    /\ w \in writes
    /\ writes' = writes \ {w}
    /\ powner' = IF pst[w.req] # "Running" /\ powner[pworker[w.req]][w.src] = w.req
                   THEN [powner EXCEPT ![pworker[w.req]][w.src] = NoReq] ELSE powner
    /\ UNCHANGED <<pworker, dworker, client, prompt, pst, sent, src, dst, table, boot, fwMsg, dfw, cancel,
                   leaked, owner, gen, content, pdata, ptable, fwCount, announced, landed,
                   tokens, salt, hit, phit, readers, ident, kv, pcached, preaders, pident>>

LossStep == \/ \E r \in Requests : LoseBootstrap(r) \/ LoseFinalWord(r) \/ LoseCancel(r)
            \/ \E w \in writes : LoseWrite(w)

-----------------------------------------------------------------------------
(* Retransmission: what keeps liveness on a network that loses messages. The router    *)
(* re-sends a bootstrap decode has not answered, and decode re-sends a cancel the        *)
(* prefill has not answered (AnswerCancel repeats the final word, so a lost final word is *)
(* asked for again too). Both are timers that rest on a timing assumption, like the lease *)
(* (spec/tlaplus/locality.py keeps these out of the sender's reads): a resend fires only   *)
(* once the message and its answer are off the wire, that is, its timer outlasts a round  *)
(* trip. A message that was not lost is answered before then, so without losses neither   *)
(* is ever enabled and every model without Losses has the state graph it had. A page      *)
(* write lost with its poster told it completed is not retransmitted: nobody knows it is   *)
(* lost (see spec/README.md). NoRetransmit removes both.                                 *)
BootstrapUnanswered(r) == ~boot[r] /\ dst[r] = "None"
BootstrapResendDue(r) == client[r] = "Waiting" /\ BootstrapUnanswered(r)

ResendBootstrap(r) ==
    /\ "NoRetransmit" \notin Bugs
    /\ BootstrapResendDue(r)
    /\ boot' = [boot EXCEPT ![r] = TRUE]
    /\ UNCHANGED <<pworker, dworker, client, prompt, pst, sent, src, dst, table, fwMsg, dfw, cancel, leaked,
                   owner, gen, content, powner, pdata, writes, ptable, fwCount,
                   announced, landed,
                   tokens, salt, hit, phit, readers, ident, kv, pcached, preaders, pident>>

CancelUnanswered(r) == ~cancel[r] /\ fwMsg[r] = "None"
CancelResendDue(r) == dst[r] = "Closing" /\ ~dfw[r] /\ CancelUnanswered(r)

ResendCancel(r) ==
    /\ "NoRetransmit" \notin Bugs
    /\ "NoCancel" \notin Bugs
    /\ CancelResendDue(r)
    /\ cancel' = [cancel EXCEPT ![r] = TRUE]
    /\ UNCHANGED <<pworker, dworker, client, prompt, pst, sent, src, dst, table, boot, fwMsg, dfw, leaked,
                   owner, gen, content, powner, pdata, writes, ptable, fwCount,
                   announced, landed,
                   tokens, salt, hit, phit, readers, ident, kv, pcached, preaders, pident>>


(* A page write lost with its poster told it completed (Losses contains "Write": an       *)
(* unreliable transport, a post that failed silently) is sent again by nobody: nobody     *)
(* knows it is lost, and decode's count never reaches what the final word announced. On  *)
(* such a transport decode arms a write timer: when it lapses, decode revokes the         *)
(* registration of the request's pages (a write that arrives later fails at the NIC and    *)
(* lands nowhere) and releases them; a transfer it had not accepted fails (ErrTransfer,   *)
(* the count check). The revocation is what makes the release safe; in the spec it is the *)
(* timing assumption WritesGone (the timer outlasts any write's flight, so no write of the *)
(* request is on the wire by then). Where writes are not lost silently (Losses without     *)
(* "Write") no such timer is armed: there a short count only means writes still on their  *)
(* way. NoRevoke removes it.                                                               *)
WritesGone(r) == WritesOf(r) = {}

RevokeRelease(r) ==
    /\ "Write" \in Losses
    /\ "NoRevoke" \notin Bugs
    /\ IF dst[r] = "Waiting"
         THEN /\ fwMsg[r] = "Done"
              /\ ~Counted(r, fwCount[r])
              /\ fwMsg' = [fwMsg EXCEPT ![r] = "None"]
              /\ fwCount' = [fwCount EXCEPT ![r] = 0]
              /\ dfw' = [dfw EXCEPT ![r] = TRUE]
              /\ announced' = [announced EXCEPT ![r] = fwCount[r]]
              /\ client' = [client EXCEPT ![r] = ClientError(r, "ErrTransfer")]
         ELSE /\ dst[r] = "Closing"
              /\ dfw[r]
              /\ ~Counted(r, announced[r])
              /\ UNCHANGED <<fwMsg, fwCount, dfw, announced, client>>
    /\ WritesGone(r)
    /\ dst' = [dst EXCEPT ![r] = "Released"]
    /\ owner' = FreedPages(r)
    /\ DropReferences(r)
    /\ UNCHANGED <<pworker, dworker, prompt, pst, sent, src, table, boot, cancel, leaked, gen,
                   content, powner, pdata, writes, ptable, landed,
                   tokens, salt, hit, phit, kv, pcached, preaders, pident>>

-----------------------------------------------------------------------------
(* The protocol's own actions are taken fairly; arrivals, client aborts, prefill        *)
(* failures and crashes are the environment's.                                         *)

(* The protocol's own steps of a request, timers apart. *)
ProtocolStep(r) ==
    \/ \E S \in SUBSET PPages : Admit(r, S)
    \/ Reject(r) \/ SendPage(r) \/ SendDone(r) \/ PrefillAbort(r) \/ AnswerCancel(r)
    \/ \E S \in SUBSET DPages : Reserve(r, S)
    \/ DecodeReject(r) \/ DropBootstrap(r) \/ Accept(r, ChecksumsMatch(r)) \/ Notice(r)
    \/ Finish(r, TagsMatch(r))
    \/ DecodeAbort(r) \/ Release(r)

FairNext == \E r \in Requests : ProtocolStep(r) \/ Timeout(r)
                                \/ ResendBootstrap(r) \/ ResendCancel(r) \/ RevokeRelease(r)

Next ==
    \/ FairNext
    \/ \E w \in writes : LandWrite(w)
    \/ \E r \in Requests : \E n \in 1..MaxPromptPages :
          \E q \in PrefillWorkers : \E d \in DecodeWorkers :
             \E t \in PromptsOf(n) : \E s \in SaltsOf : Arrive(r, n, q, d, t, s)
    \/ \E d \in DecodeWorkers : \E p \in DPages : Evict(d, p)
    \/ \E q \in PrefillWorkers : \E p \in PPages : PrefillEvict(q, p)
    \/ \E r \in Requests : Abort(r) \/ PrefillFail(r)
    \/ \E q \in PrefillWorkers : PrefillCrash(q)
    \/ \E d \in DecodeWorkers : DecodeCrash(d)
    \/ \E r \in Requests : LoseBootstrap(r) \/ LoseFinalWord(r) \/ LoseCancel(r)
    \/ \E w \in writes : LoseWrite(w)

(* A write that is posted eventually lands: LandWrite is fair too. *)
Progress == FairNext \/ \E w \in writes : LandWrite(w)

Spec == Init /\ [][Next]_vars
FairSpec == Spec /\ WF_vars(Progress)

(* A network that loses things may not lose for ever: from some point on it loses nothing *)
(* (finitely many losses per behaviour). The lossy models' liveness is claimed under this, *)
(* and kvproof's checker decides it by proving the graph acyclic once loss steps are left  *)
(* out (spec/check/checker.py). Where Losses = {} no loss is ever enabled: it is FairSpec. *)
FiniteLosses == <>[][~LossStep]_vars
LossyFairSpec == FairSpec /\ FiniteLosses

Symmetry == Permutations(Requests)
(* Workers of a kind are interchangeable too (model values, compared only for equality). *)
WorkerSymmetry == Permutations(Requests) \cup Permutations(PrefillWorkers)
                  \cup Permutations(DecodeWorkers)

-----------------------------------------------------------------------------
(* Safety. *)

Isolation == leaked = {}

OkIsClean == \A r \in Requests : client[r] = "Ok" => r \notin leaked

ExclusiveOwner ==
    /\ \A d \in DecodeWorkers : \A p \in DPages : owner[d][p] # NoReq =>
          /\ HoldsPages(owner[d][p])
          /\ dworker[owner[d][p]] = d
          /\ [page |-> p, gen |-> gen[d][p]] \in Range(table[owner[d][p]])
    /\ \A r \in Requests : HoldsPages(r) =>
          \A i \in DOMAIN table[r] : /\ \/ owner[dworker[r]][table[r][i].page] = r
                                        \/ r \in readers[dworker[r]][table[r][i].page]
                                     /\ gen[dworker[r]][table[r][i].page] = table[r][i].gen
    /\ \A q \in PrefillWorkers : \A p \in PPages : powner[q][p] # NoReq =>
          /\ pworker[powner[q][p]] = q
          /\ pst[powner[q][p]] = "Running" \/ Reading(q, p)
          /\ p \in Range(src[powner[q][p]])

NoWriteIntoForeign == \A w \in writes : /\ owner[dworker[w.req]][w.dst] = w.req
                                        /\ gen[dworker[w.req]][w.dst] = w.gen

(* Prefix caching (true at once without PrefixCache: nothing is ever cached). A page is   *)
(* shared only within a salt: every reader of a page, and the request whose KV its memory *)
(* holds, have one salt.                                                                 *)
SaltsApart == /\ \A d \in DecodeWorkers : \A p \in DPages : \A r \in readers[d][p] :
                     kv[d][p] # NoIdent /\ kv[d][p][1] = salt[r]
              /\ \A q \in PrefillWorkers : \A p \in PPages : \A r \in preaders[q][p] :
                     SourceIdent(q, p) # NoIdent /\ SourceIdent(q, p)[1] = salt[r]

(* A page's readers are exactly its live readers: the requests holding pages at its      *)
(* worker whose table has it and that do not own it (never fewer: a release would free it *)
(* under a reader; never more: a reference nobody drops pins the page for ever).          *)
(* On the prefill side (PrefillCache) a cached page's readers are exactly the running     *)
(* requests that hit it at Admit (the first pcached of their sources). Each side is       *)
(* stated as its two directions, each over what it is about (a page's readers; a live     *)
(* request's pages), not over every request for every page: the same formula, but a      *)
(* deployment's run with 10,000 request slots is checked in seconds instead of a minute.  *)
PHitSources(r) == {src[r][i] : i \in 1..Min(pcached[r], Len(src[r]))}
ReadersAreLive ==
    /\ \A d \in DecodeWorkers : \A p \in DPages : \A r \in readers[d][p] :
          HoldsPages(r) /\ dworker[r] = d /\ p \in TablePages(r) /\ owner[d][p] # r
    /\ \A r \in Requests : HoldsPages(r) /\ dworker[r] \in DecodeWorkers =>
          \A p \in TablePages(r) : owner[dworker[r]][p] # r => r \in readers[dworker[r]][p]
    /\ \A q \in PrefillWorkers : \A p \in PPages : \A r \in preaders[q][p] :
          pst[r] = "Running" /\ pworker[r] = q /\ p \in PHitSources(r)
    /\ \A r \in Requests : pst[r] = "Running" /\ pworker[r] \in PrefillWorkers =>
          \A p \in PHitSources(r) : r \in preaders[pworker[r]][p]

(* A page with readers is sealed and owned by nobody, and no write is on its way into a   *)
(* sealed page: no eviction or allocation can take a page with readers or a write pending. *)
(* On the prefill side a page with readers is sealed and owned by nobody: no eviction or   *)
(* allocation takes a cached source a request still reads (SourceHeld: nor one a write in *)
(* flight reads out of).                                                                 *)
SealedIsQuiet == /\ \A d \in DecodeWorkers : \A p \in DPages :
                     /\ readers[d][p] # {} => ident[d][p] # NoIdent
                     /\ ident[d][p] # NoIdent =>
                          /\ owner[d][p] = NoReq
                          /\ ~\E w \in writes : dworker[w.req] = d /\ w.dst = p
                 /\ \A q \in PrefillWorkers : \A p \in PPages :
                     /\ preaders[q][p] # {} => pident[q][p] # NoIdent
                     /\ pident[q][p] # NoIdent => powner[q][p] = NoReq

(* Every write in flight reads a source its request holds: one it owns, or (PrefillCache) *)
(* a cached page it reads, still sealed.                                                  *)
SourceHeld == \A w \in writes :
                  \/ powner[pworker[w.req]][w.src] = w.req
                  \/ /\ w.req \in preaders[pworker[w.req]][w.src]
                     /\ pident[pworker[w.req]][w.src] # NoIdent

RejectedIsError == \A r \in Requests : Overlong(r) => client[r] # "Ok" /\ dst[r] # "Decoding"

(* The count check, the checksums and the tag check are backstops: with every guard in    *)
(* place (no bug switch) and no fault that corrupts data (this spec has none: crashes     *)
(* flush writes together with the requests they belong to, and a write the network loses *)
(* (Losses) is never counted as landed, so decode never verifies it), none of them ever   *)
(* fires, except the count check where the network may lose a write silently: the write   *)
(* timer then fails the transfer (RevokeRelease). A protocol that lost writes on its own   *)
(* path would fail requests here.                                                         *)
NoGuardTripWithoutFault ==
    Bugs = {} => \A r \in Requests :
        client[r] \notin {"ErrTag"} \cup (IF "Write" \in Losses THEN {} ELSE {"ErrTransfer"})

(* At rest no fair action is enabled: only the environment could move the system. *)
AtRest == ~ENABLED Progress

AllFree == /\ writes = {}
           /\ \A d \in DecodeWorkers : \A p \in DPages : owner[d][p] = NoReq
           /\ \A q \in PrefillWorkers : \A p \in PPages : powner[q][p] = NoReq

Ended(r) == /\ client[r] # "Waiting"
            /\ pst[r] \notin {"Queued", "Running"}
            /\ ~HoldsPages(r)
            /\ ~boot[r] /\ fwMsg[r] = "None" /\ ~cancel[r]

(* With every guard in place, a resend is due only where the network may lose what it     *)
(* sends again: the resends' timing assumption holds only after a loss (a decode that      *)
(* forgot a final word it heard would look like one, and retransmission would hide it).   *)
NoResendWithoutLoss ==
    Bugs = {} => \A r \in Requests :
        /\ BootstrapResendDue(r) => "Bootstrap" \in Losses
        /\ CancelResendDue(r) => Losses \cap {"Cancel", "FinalWord"} # {}

NoLeakAtRest == AtRest => AllFree

NoStuckRequest == AtRest => \A r \in Requests : Ended(r)

(* Something has to succeed. When nothing but a transfer timer could move the protocol on *)
(* (no protocol step and no write landing is enabled), every request whose prompt fits    *)
(* the pools and that no fault has ended (a client abort, a prefill failure or crash, a   *)
(* decode crash, a timeout) has its Ok. A protocol whose prefill never said Done would   *)
(* leave every request waiting for its timer here. The one excuse is a timer that is the  *)
(* designed recovery from a fault: decode learns of a prefill crash by timing out, and    *)
(* until then the crashed request's pages may keep another request from reserving.       *)
QuietButTimers == /\ ~ENABLED (\E r \in Requests : ProtocolStep(r))
                  /\ ~ENABLED (\E w \in writes : LandWrite(w))

(* A timeout is a fault's outcome only where timers may fire early: with timely timers a  *)
(* fitting request that times out was failed by the protocol.                             *)
(* Where writes may be lost silently, a transfer failed by the write timer is a fault's    *)
(* outcome too.                                                                          *)
FaultOutcomes == {"Gone", "ErrPrefill", "ErrDecode"}
                 \cup (IF EarlyTimeouts THEN {"ErrTimeout"} ELSE {})
                 \cup (IF "Write" \in Losses THEN {"ErrTransfer"} ELSE {})

Fits(r) == prompt[r] <= Min(Advertised, Min(PrefillPages, DecodePages))

(* A loss is a fault as well, and a timer its designed recovery: a message's resend,      *)
(* decode's write timer for a write lost silently, or for a final word lost while decode   *)
(* waits, decode's timeout (the prefill has gone silent on the request; the cancel has the *)
(* final word repeated).                                                                   *)
LossRecoveryDue(r) == \/ ENABLED ResendBootstrap(r) \/ ENABLED ResendCancel(r)
                      \/ ENABLED RevokeRelease(r)
                      \/ "FinalWord" \in Losses /\ dst[r] = "Waiting" /\ PrefillSilent(r)

RecoveringFromFault == \E r \in Requests : \/ client[r] \in FaultOutcomes /\ dst[r] = "Waiting"
                                           \/ LossRecoveryDue(r)

FittingRequestsSucceed ==
    QuietButTimers /\ ~RecoveringFromFault => \A r \in Requests :
        (client[r] \notin {"Idle"} \cup FaultOutcomes /\ Fits(r)) => client[r] = "Ok"

-----------------------------------------------------------------------------
(* Liveness, under FairSpec. *)

EveryRequestEnds == \A r \in Requests : client[r] # "Idle" ~> Ended(r)

PagesComeBack == <>[]AllFree

-----------------------------------------------------------------------------
(* Step properties: promises about every step, checked by TLC as action properties. *)

Answered(r) == client[r] \notin {"Idle", "Waiting"}

(* Once a client has its answer (Ok, an error, or gone), it never changes. *)
AnswerNeverChanges == [][\A r \in Requests : Answered(r) => client'[r] = client[r]]_vars

(* A request decode has closed never waits for KV or decodes again. *)
ClosedNeverReopens ==
    [][\A r \in Requests : dst[r] \in {"Closing", "Released", "Tomb"} =>
                               dst'[r] \notin {"Waiting", "Decoding"}]_vars

(* A page's generation never goes back, across decode crashes too: a tag once issued is  *)
(* never issued again.                                                                   *)
GenerationsNeverGoBack ==
    [][\A d \in DecodeWorkers : \A p \in DPages : gen'[d][p] >= gen[d][p]]_vars

(* A tombstone is never revived: decode never forgets a request it buried. *)
TombstonesStay == [][\A r \in Requests : dst[r] = "Tomb" => dst'[r] = "Tomb"]_vars

=============================================================================
